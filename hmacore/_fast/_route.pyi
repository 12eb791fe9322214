"""Bulk application of KV events to one engine's counted residency (see _route.pyx)."""
import numpy as np
import numpy.typing as npt

from ._hits import ExistenceSet

def apply_rows(layers: list[ExistenceSet], ops: npt.NDArray[np.int8],
               groups: npt.NDArray[np.int32],
               digests: npt.NDArray[np.uint8]) -> tuple[int, int, int, int]: ...
def pack_event_lists(ops: list[int], groups: list[int], hashes: list[int], num_groups: int
                     ) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int32],
                                npt.NDArray[np.uint8]]: ...
