"""benchmarks/stream_timeline.py's analysis of a replay's kernels (plain Python, no GPU): which stream is the
main chain, its idle windows and the side kernel each one waited on."""
import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "stream_timeline.py")
_spec = importlib.util.spec_from_file_location("stream_timeline", _PATH)
st = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("stream_timeline", st)  # dataclasses look their module up
_spec.loader.exec_module(st)
K = st.Kernel


def test_main_stream_is_the_fork_and_join_chain_not_the_busiest():
    # stream 7 forks at t=0 and joins at the end; stream 9 has more kernels but runs inside the span
    ks = [K(7, 0, 2, "hc_pre"), K(9, 2.5, 3, "a"), K(9, 3, 4, "b"), K(9, 4, 5, "c"), K(9, 5, 9, "scores"),
          K(7, 2, 6, "wq_b"), K(7, 10, 12, "attn")]
    tl = st.main_stream_path(ks, idle_floor_us=0.5)
    assert tl.main_stream == 7
    assert [s.name for s in tl.steps] == ["hc_pre", "wq_b", "attn"]
    assert tl.span_us == 12
    assert tl.main_busy_us == pytest.approx(8)
    assert tl.main_idle_us == pytest.approx(4)  # 6 -> 10
    assert tl.steps[2].waited_on == "scores"  # the side kernel that ended last before attn began
    assert tl.steps[1].waited_on is None  # no idle before wq_b
    assert tl.side_kernels == 4 and tl.side_us == pytest.approx(6.5)


def test_idle_below_the_floor_names_no_wait_and_overlap_counts_no_idle():
    ks = [K(1, 0, 5, "x"), K(1, 4, 6, "overlapping (PDL)"), K(1, 6.3, 7, "y"), K(2, 1, 6.2, "side")]
    tl = st.main_stream_path(ks, idle_floor_us=0.5)
    assert [s.idle_before_us for s in tl.steps] == [0.0, 0.0, pytest.approx(0.3)]
    assert all(s.waited_on is None for s in tl.steps)
    text = st.format_timeline(tl, rows=3)
    assert "main stream 1: 3 kernels" in text and "overlapping (PDL)" in text


def test_no_kernels_is_an_error_not_an_empty_table():
    with pytest.raises(ValueError, match="no kernels"):
        st.main_stream_path([])
