"""Connector variants for bench/product_ab.py (each module exports the class it replaces)."""
