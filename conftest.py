# Repository root on sys.path: tests import the in-place build of hmacore.
