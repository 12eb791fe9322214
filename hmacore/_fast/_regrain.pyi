"""Typed stub of hmacore._fast._regrain (block-size remapping kernel)."""
from typing import Any

import numpy as np
import numpy.typing as npt

def map_runs(pair_group: Any, pair_state: Any, src_base: Any, src_stride: Any, src_dev: Any,
             src_kbs: Any, src_klen: Any, dst_base: Any, dst_stride: Any, dst_dev: Any,
             dst_kbs: Any, dst_klen: Any, state_len: Any, chunk_lo: Any, chunk_src_off: Any,
             chunk_dst_off: Any, chunk_row: Any, src_bs: Any, dst_bs: Any, src_ids: Any,
             src_off: Any, src_first: Any, dst_ids: Any, dst_off: Any, dst_first: Any,
             lo: Any, hi: Any) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64],
                                        npt.NDArray[np.int64]]: ...
