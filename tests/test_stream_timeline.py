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
    # ('early' also ends inside main's idle window, before 'scores')
    ks = [K(7, 0, 2, "hc_pre"), K(9, 2.5, 3, "a"), K(9, 3, 4, "b"), K(9, 4, 5, "c"), K(9, 5, 9, "scores"),
          K(11, 6, 7, "early"), K(7, 2, 6, "wq_b"), K(7, 10, 12, "attn")]
    tl = st.main_stream_path(ks, idle_floor_us=0.5)
    assert tl.main_stream == 7
    assert [s.name for s in tl.steps] == ["hc_pre", "wq_b", "attn"]
    assert tl.span_us == 12
    assert tl.main_busy_us == pytest.approx(8)
    assert tl.main_idle_us == pytest.approx(4)  # 6 -> 10
    assert tl.steps[2].waited_on == "scores"  # the side kernel that ended last before attn began
    assert tl.steps[1].waited_on is None  # no idle before wq_b
    assert tl.side_kernels == 5 and tl.side_us == pytest.approx(7.5)


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


def test_critical_path_follows_the_latest_dependency_across_streams():
    # a fork at 'x': the short branch (s, 2 us) and the long one (a, b: 7 us) on different streams, the join 'j'
    # starts after the long one; the path is x -> a -> b -> j whatever the streams are called
    ks = [K(1, 0, 1, "x"), K(2, 1.2, 3.2, "s"), K(3, 1.3, 5, "a"), K(1, 5.2, 8.3, "b"), K(1, 8.5, 9, "j")]
    chain = st.critical_path(ks)
    assert [s.name for s in chain] == ["x", "a", "b", "j"]
    assert chain[0].idle_before_us == 0.0
    assert [round(s.idle_before_us, 3) for s in chain[1:]] == [0.3, 0.2, 0.2]
    assert sum(s.us for s in chain) == pytest.approx(1 + 3.7 + 3.1 + 0.5)
    text = st.format_critical_path(chain, rows=4)
    assert text.startswith("critical path: 4 kernels") and " s\n" not in text
    with pytest.raises(ValueError, match="no kernels"):
        st.critical_path([])


def test_kernel_table_sums_by_name_over_the_span():
    ks = [K(1, 0, 2, "gemm"), K(2, 1, 4, "norm"), K(1, 5, 9, "gemm"), K(1, 9, 9.5, "norm")]
    t = st.kernel_table(ks, top=1)
    assert t["kernels"] == 4 and t["kernel_us"] == pytest.approx(9.5) and t["span_us"] == pytest.approx(9.5)
    assert t["top"] == [("gemm", 2, pytest.approx(6.0))]
    assert st.kernel_table([], top=3) == {"kernels": 0}
