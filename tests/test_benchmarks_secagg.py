"""benchmarks/secagg.py's own checks: blind's sessions measured against secagg's, every sum read to the bit,
and consortium rounds compared against whichever layer comes first."""

from __future__ import annotations

import statistics
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.ring import FixedPointCodec
from tests.test_benchmarks_load import bench as bench  # the module-scoped fixture: the script, loaded

PHASES = (
    "round_s",
    "start_to_last_contribution_s",
    "last_contribution_to_commit_s",
    "commit_to_next_start_s",
)


@pytest.fixture(scope="module")
def schema(bench):
    return bench.contribution_schema("cnn-small")


@pytest.fixture(scope="module")
def costs(bench, schema, tmp_path_factory):
    """One repeat at n = 4 (t = 3: both dropout cases run), secagg and blind in the same sessions."""
    members = bench.Members.issue(tmp_path_factory.mktemp("members"), 4)
    return bench.session_costs(4, 1, schema, members, others=("blind",))


def test_blind_uploads_what_secagg_uploads(costs):
    secagg, blind = costs["bytes_per_silo"], costs["layers"]["blind"]["bytes_per_silo"]
    assert blind["up"]["Submit (masked)"] == secagg["up"]["Submit (masked)"]  # the output mask adds no byte
    assert set(blind["up"]) == set(secagg["up"])
    assert blind["ratio_up_over_secagg"] == pytest.approx(1, abs=1e-3)  # ECDSA signatures vary by a byte


def test_each_blind_silo_fetches_one_ring_vector(costs):
    blind = costs["layers"]["blind"]["bytes_per_silo"]
    ring = costs["ring"]["bytes"]
    assert ring <= blind["total_fetched"] < ring * 1.001 + 16  # the vector and its stream's framing
    assert blind["down"]["BlindTotal"] < 256  # the SumStep only announces it
    assert blind["down_beyond_secagg"] == pytest.approx(blind["total_fetched"] + 142, abs=64)


def test_blind_times_every_stage_and_dropout_secagg_does(costs):
    blind = costs["layers"]["blind"]
    assert set(blind["unmask_s_median"]) == {"none", "after_masked", "before_masked"}
    assert blind["reading_s_median"] > 0
    assert blind["output_mask_only_s_median"] > 0
    assert blind["masking_s_median"] > 0


def test_blind_bytes_per_round_beside_the_sum(bench):
    per_round = bench.blind_round_bytes("cnn-small", 3)
    assert per_round["sealed_state"] == per_round["packed_state"] + 12 + 16  # nonce and Poly1305 tag
    assert per_round["sealed_state"] <= per_round["sealed_state_stream"] < per_round["sealed_state"] + 64
    assert 0 < per_round["masked_counts_payload"] < 1024


def sum_of(schema, inputs, silos) -> object:
    codec = FixedPointCodec(schema, max_silos=len(inputs))
    grid = codec.ring.zeros()
    for u in silos:
        codec.ring.add(grid, codec.encode(inputs[u]))
    return codec.decode(grid)


def test_the_sum_check_takes_only_the_fixed_point_sum_to_the_bit(bench, schema):
    inputs = {u: bench.contribution(schema, seed=k) for k, u in enumerate(("a", "b", "c"))}
    bench.check_sum(schema, ("a", "b", "c"), sum_of(schema, inputs, "abc"), inputs, reader="x")
    float_sum = sum(inputs.values())  # within the codec's bound, but not what the ring adds up to
    with pytest.raises(RuntimeError, match="not the fixed-point sum"):
        bench.check_sum(schema, ("a", "b", "c"), float_sum, inputs, reader="x")
    with pytest.raises(RuntimeError, match="not the fixed-point sum"):  # a survivor left out
        bench.check_sum(schema, ("a", "b", "c"), sum_of(schema, inputs, "ab"), inputs, reader="x")


def run(rounds: list[float], *, measured: bool = True, training: float | None = None) -> dict:
    beyond = {} if training is None else {"beyond_training_s": [r - training for r in rounds]}
    return (
        {"measured": measured, **{p: list(rounds) for p in PHASES}}
        | beyond
        | ({} if measured else {"reason": "stopped after 1 minutes with 1/6 rounds"})
    )


def test_rounds_compare_every_layer_with_the_first(bench):
    layers = ("secagg", "blind", "ckks")
    runs = {
        "secagg": [run([10, 10, 12]), run([10, 11, 11])],
        "blind": [run([11, 11, 11]), run([12, 12, 12])],
        "ckks": [run([15]), run([20], measured=False)],
    }
    entry = bench.compared(runs, layers)
    assert entry["ratio_blind_over_secagg"] == round(11.5 / 10.5, 3)
    assert entry["ratio_blind_per_pair"] == [1.1, round(12 / 11, 3)]
    assert entry["ratio_ckks_over_secagg"] is None
    assert "ratio_ckks_per_pair" not in entry
    assert "beyond_training_blind_minus_secagg_s" not in entry  # no training lines in these runs
    table = bench.rounds_table(
        {"layers": list(layers), "baseline": "secagg", "by_silos": [{"silos": 3, **entry}]}
    )
    header, row = table.splitlines()
    assert "blind/secagg" in header
    assert "ckks/secagg" in header
    assert "not measured" in row
    assert "stopped after 1 minutes" in row


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.floats(1, 100), min_size=1, max_size=5),
            st.lists(st.floats(1, 100), min_size=1, max_size=5),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_ratios_are_of_medians_over_the_pooled_rounds_and_per_pair(bench, pairs):
    runs = {"plaintext": [run(p) for p, _ in pairs], "blind": [run(b) for _, b in pairs]}
    entry = bench.compared(runs, ("plaintext", "blind"))
    pooled = statistics.median(x for _, b in pairs for x in b) / statistics.median(
        x for p, _ in pairs for x in p
    )
    assert entry["ratio_blind_over_plaintext"] == pytest.approx(pooled, rel=2e-3, abs=1e-3)  # medians rounded
    assert len(entry["ratio_blind_per_pair"]) == len(pairs)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["session", "--layers", "blind"], "--layers starts with secagg"),
        (["session", "--layers", "secagg", "blind", "blind"], "names each layer once"),
        (["session", "--layers", "secagg", "ckks"], "invalid choice: 'ckks'"),
        (["rounds", "--layers", "secagg"], "two layers or more"),
        (["rounds", "--layers", "secagg", "blind", "secagg"], "each once"),
        (["rounds", "--layers", "secagg", "sharemind"], "invalid choice: 'sharemind'"),
    ],
)
def test_the_command_line_refuses_layers_it_cannot_compare(bench, monkeypatch, capsys, argv, error):
    monkeypatch.setattr(sys, "argv", ["secagg.py", *argv])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_rounds_are_also_compared_beyond_the_slowest_training(bench):
    runs = {
        "secagg": [run([10, 12], training=8), run([6, 6], training=4)],  # others' load slowed the first
        "blind": [run([11, 11], training=8.5)],
    }
    runs["blind"].append(run([7, 7], training=4.5))
    entry = bench.compared(runs, ("secagg", "blind"))
    assert entry["secagg"]["beyond_training_s_median"] == 2
    assert entry["blind"]["beyond_training_s_median"] == 2.5
    assert entry["beyond_training_blind_minus_secagg_s"] == 0.5
    table = bench.rounds_table(
        {"layers": ["secagg", "blind"], "baseline": "secagg", "by_silos": [{"silos": 3, **entry}]}
    )
    assert "2.000 | 2.500" in table.splitlines()[1]


def test_the_slowest_training_of_each_round_is_read_from_the_silos_logs(bench, tmp_path):
    line = "2026-11-28 09:38:30,395 silo INFO round {}: trained on {} samples in {:.2f} s\n"
    (tmp_path / "silo-0.log").write_text(line.format(1, 369, 20.5) + line.format(2, 369, 10.25))
    (tmp_path / "silo-1.log").write_text(line.format(1, 118, 5.0) + line.format(2, 118, 12.0) + "other\n")
    (tmp_path / "aggregator.log").write_text(line.format(2, 1, 99.0))  # no silo's
    assert bench.slowest_training(tmp_path) == {1: 20.5, 2: 12.0}
