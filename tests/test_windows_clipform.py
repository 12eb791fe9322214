"""windows.clip_windows (vLLM's clipper contract: whole groups pass through, cut groups keep
their form and are validated) against the oracle, and its bad-input behaviour."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmacore.errors import BlockTableError
from hmacore.presets import get_preset
from hmacore.spec import GroupKind
from hmacore.windows import clip_to_window, clip_windows
from tests import oracle_core as oracle

NB = 500
LAYOUTS = [get_preset(p, num_blocks=NB) for p in ("gpt-oss-120b", "deepseek-v4", "qwen3-next-80b")]


def as_list(x):
    return x if isinstance(x, list) else list(x) if isinstance(x, tuple) else x.tolist()


@settings(max_examples=80, deadline=None)
@given(data=st.data(), li=st.integers(0, 2), exact=st.booleans(), clip_state=st.booleans(),
       form=st.sampled_from(["list", "tuple", "int32"]))
def test_clip_windows_matches_oracle_and_clip_to_window(data, li, exact, clip_state, form):
    layout = LAYOUTS[li]
    t = [data.draw(st.lists(st.integers(0, NB - 1), max_size=40)) for _ in layout.groups]
    conv = {"list": list, "tuple": tuple, "int32": lambda x: np.array(x, dtype=np.int32)}[form]
    inp = tuple(conv(x) for x in t)
    got = clip_windows(inp, layout, exact=exact, clip_state=clip_state)
    want = oracle.clip(t, oracle.layout_to_dicts(layout), exact, clip_state)
    assert [as_list(x) for x in got] == [list(x) for x in want]
    assert [as_list(x) for x in got] == \
        [x.tolist() for x in clip_to_window(inp, layout, exact=exact, clip_state=clip_state)]
    for g, spec in enumerate(layout.groups):
        whole = spec.kind in (GroupKind.FULL, GroupKind.CHUNKED_LOCAL) or \
            (spec.kind == GroupKind.MAMBA and not clip_state)
        if whole:
            assert got[g] is inp[g]            # passed through, not copied
        elif form == "int32":
            assert got[g].dtype == np.int32 and (got[g].size == 0 or np.shares_memory(got[g], inp[g]))
        else:
            assert isinstance(got[g], (list, tuple))


def test_clip_windows_validates_cut_groups_only():
    layout = LAYOUTS[0]                        # gpt-oss: group 0 SW (window 128, bs 16), 1 FA
    sw = 0 if layout.groups[0].kind == GroupKind.SLIDING_WINDOW else 1
    fa = 1 - sw
    t = [None, None]
    t[fa] = [NB + 5, -1]                      # whole group: not inspected
    t[sw] = [-7] + list(range(1, 12))         # -7 is cut away
    got = clip_windows(tuple(t), layout)
    assert got[fa] is t[fa]
    t[sw] = list(range(1, 12)) + [NB]
    with pytest.raises(BlockTableError, match=f"group {sw}, index 11: block id {NB} is >= num_blocks"):
        clip_windows(tuple(t), layout)
    t[sw] = list(range(1, 12)) + [1.5]
    with pytest.raises(BlockTableError, match=f"group {sw}"):
        clip_windows(tuple(t), layout)


def test_clip_windows_rejects_shape_and_layout():
    layout = LAYOUTS[0]
    assert clip_windows((), layout) == ()
    with pytest.raises(BlockTableError, match="block_ids has 1 groups, the layout has 2"):
        clip_windows(([1],), layout)
    with pytest.raises(TypeError, match="layout must be a KVLayout"):
        clip_windows(([1], [2]), "gpt-oss")
    got = clip_windows((np.array([1, 2], np.int64), [3]), layout)   # other forms: converted
    assert [as_list(x) for x in got] == [[1, 2], [3]]
