"""Typed stub of hmacore._fast._plan (descriptor-id flattening)."""
from typing_extensions import disjoint_base
import numpy as np
import numpy.typing as npt

BLOCK_ID_DTYPE: np.dtype[np.int32]
DESC_ID_DTYPE: np.dtype[np.int64]
GROUP_ID_DTYPE: np.dtype[np.int32]

def count_desc_ids(block_ids: tuple[npt.NDArray[np.int32], ...],
                   region_ratio: npt.NDArray[np.int32], region_group: npt.NDArray[np.int32],
                   region_state: npt.NDArray[np.uint8], group_state: npt.NDArray[np.uint8],
                   kernel_ids: bool) -> int: ...

def flatten_desc_ids(block_ids: tuple[npt.NDArray[np.int32], ...],
                     region_offset: npt.NDArray[np.int64], region_logical: npt.NDArray[np.int64],
                     region_ratio: npt.NDArray[np.int32], region_group: npt.NDArray[np.int32],
                     region_state: npt.NDArray[np.uint8], group_state: npt.NDArray[np.uint8], *,
                     group_major: bool, kernel_ids: bool = ..., allow_null: bool = ...,
                     out: npt.NDArray[np.int64] | None = ...) -> npt.NDArray[np.int64]: ...

@disjoint_base
class DescPlan:
    def __init__(self, region_offset: npt.NDArray[np.int64], region_logical: npt.NDArray[np.int64],
                 region_ratio: npt.NDArray[np.int32], region_group: npt.NDArray[np.int32],
                 region_state: npt.NDArray[np.uint8], group_state: npt.NDArray[np.uint8],
                 group_major: bool, convert: object = ...) -> None: ...
    def __reduce__(self) -> tuple[object, tuple[object, ...]]: ...
    def run(self, block_ids: object, *, kernel_ids: bool = ..., allow_null: bool = ...,
            out: npt.NDArray[np.int64] | None = ...) -> npt.NDArray[np.int64]: ...
    def pair_ids32(self, remote: DescPlan, local_ids: object, remote_ids: object,
                   group_bytes: object) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32],
                                                 tuple[npt.NDArray[np.int32], ...], int] | None: ...
