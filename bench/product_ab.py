"""A/B of one product-benchmark variant against a changed copy, side by side in one run.

    python bench/product_ab.py hma_push_P ab_probes.push_extra_allocs \
        --layouts gptoss --requests 256 --prompts 32768 --kinds prefill \
        --variants vllm_nixl_P hma_push_P --steps 120 --out /tmp/ab

Adds the variant ``<variant>_ab``: ``<variant>``'s settings with its connector class taken from
``<module>`` (a module under bench/ exporting a class of the same name, e.g. a subclass whose
scheduler side changes one method), then runs :func:`bench_product.main` with the remaining
arguments (``<variant>_ab`` is added to ``--variants``; ``--in-process`` is implied: a child
process would not know the added variant). Both run in lockstep in one process, so machine
load hits them alike: the comparison is the two columns of the same run, never figures of
different runs. Probes: bench/ab_probes/.
"""
from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_product as B  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in B.VARIANT_NAMES:
        print(__doc__, file=sys.stderr)
        print(f"variant must be one of {B.VARIANT_NAMES}", file=sys.stderr)
        return 2
    name, module, rest = argv[0], argv[1], list(argv[2:])
    base = next(v for v in B.VARIANTS if v.name == name)
    ab = dataclasses.replace(base, name=f"{name}_ab", module=module,
                             note=f"{name} with its connector from {module}")
    B.VARIANTS = B.VARIANTS + (ab,)
    B.VARIANT_NAMES = B.VARIANT_NAMES + (ab.name,)
    if "--variants" in rest:
        rest.insert(rest.index("--variants") + 1, ab.name)
    if "--in-process" not in rest:
        rest.append("--in-process")
    return B.main(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
