"""Pipeline schedules (pure Python): each schedule is a valid table of the rounds the executor
runs (every stage runs every slot of a round), its executed bubble is the textbook formula
exactly, its memory is what it promises, and the validator catches broken tables. The executor
that runs these rounds over the ``pipe`` axis is tested elsewhere."""

from __future__ import annotations

from fractions import Fraction

import pytest

from jaxpar.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Table,
    as_soon_as_possible,
    dualpipe_v,
    gpipe,
    interleaved,
    one_f_one_b,
    placement_of,
    schedule_rounds,
    schedule_table,
    stage_of,
    table_of,
    zero_bubble,
)
from jaxpar.parallel.pipeline.timeline import (
    bubble_fraction,
    peak_in_flight,
    peak_weight_stash,
    render,
    validate,
)

SIZES = [(2, 4), (2, 8), (4, 4), (4, 8)]  # (p stages, m microbatches)
V = 2  # chunks per stage for the interleaved schedule


def with_stage(table: Table, stage: int, column: list[Action | None]) -> Table:
    """``table`` with one stage's column replaced (padded with idle ticks at the end)."""
    column = column + [None] * (len(table) - len(column))
    return [tick[:stage] + (column[t],) + tick[stage + 1:] for t, tick in enumerate(table)]


def column(table: Table, stage: int) -> list[Action | None]:
    return [tick[stage] for tick in table]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("p,m", SIZES)
def test_every_schedule_builds_a_valid_table(name, p, m):
    v = V if name in ("interleaved", "dualpipe_v") else 1
    validate(schedule_table(name, p, m, v), p, m, v, placement_of(name))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 6, 9])
def test_tables_stay_valid_for_odd_sizes_including_fewer_microbatches_than_stages(p, m):
    for table, v in [(gpipe(p, m), 1), (one_f_one_b(p, m), 1), (zero_bubble(p, m), 1)]:
        validate(table, p, m, v)
    if m % p == 0:
        for v in (1, 3):
            validate(interleaved(p, m, v), p, m, v)
    if m % p == 0:
        validate(zero_bubble(p, m, 3), p, m, 3)
    assert bubble_fraction(zero_bubble(p, m)) <= bubble_fraction(one_f_one_b(p, m))


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_idle_fraction_is_exactly_p_minus_1_over_m_plus_p_minus_1(p, m):
    assert bubble_fraction(gpipe(p, m)) == Fraction(p - 1, m + p - 1)
    assert bubble_fraction(one_f_one_b(p, m)) == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_idle_fraction_is_exactly_p_minus_1_over_vm_plus_p_minus_1(p, m):
    assert bubble_fraction(interleaved(p, m, V)) == Fraction(p - 1, V * m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("v", [1, 2])
def test_zero_bubble_takes_the_least_ticks_uniform_rounds_allow(p, m, v):
    # vm + p - 1 rounds with a forward slot, as many with an I slot, vm of them with a W slot:
    # (p - 1)(T_F + T_I) idle per stage, where 1F1B and interleaved idle (p - 1)(T_F + T_B).
    rounds = schedule_rounds("zero_bubble", p, m, v)
    assert sum("F" in s.kinds for s in rounds) == v * m + p - 1
    assert sum("I" in s.kinds for s in rounds) == v * m + p - 1
    assert sum("W" in s.kinds for s in rounds) == v * m
    assert len(zero_bubble(p, m, v)) == 2 * (v * m + p - 1) + v * m
    assert bubble_fraction(zero_bubble(p, m, v)) == Fraction(2 * (p - 1),
                                                             3 * v * m + 2 * (p - 1))


def test_zero_bubble_at_4_stages_and_16_microbatches_beats_1f1b_and_interleaved():
    assert (len(zero_bubble(4, 16)), len(one_f_one_b(4, 16))) == (54, 57)
    assert (len(zero_bubble(4, 16, 2)), len(interleaved(4, 16, 2))) == (102, 105)
    assert float(bubble_fraction(zero_bubble(4, 16, 2))) == pytest.approx(0.0588, abs=1e-4)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("v", [1, 2])
def test_zero_bubble_runs_each_stages_kth_w_in_one_round_after_every_stages_kth_i(p, m, v):
    rounds = schedule_rounds("zero_bubble", p, m, v)
    for rnd in rounds:
        if "W" in rnd.kinds:  # no stage idles in a W slot
            assert all("W" in actions for actions in rnd.actions)
    for s in range(p):
        done = {(a.mb, a.chunk): t for t, rnd in enumerate(rounds)
                for kind, a in rnd.actions[s].items() if kind == "I"}
        for t, rnd in enumerate(rounds):
            if (w := rnd.actions[s].get("W")) is not None:
                assert done[(w.mb, w.chunk)] <= t


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_runs_warm_up_steady_and_cool_down_rounds_at_the_ideal_cost(p, m):
    # (p-1) forward-only rounds, m forward+backward rounds, (p-1) backward-only rounds.
    rounds = schedule_rounds("1f1b", p, m)
    assert [s.kinds for s in rounds] == [("F",)] * (p - 1) + [("F", "B")] * m + [("B",)] * (p - 1)
    assert len(one_f_one_b(p, m)) == (p - 1) * 1 + m * 3 + (p - 1) * 2
    useful = 3 * m
    assert Fraction(len(one_f_one_b(p, m)), useful) == Fraction(m + p - 1, m)


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_holds_2p_minus_1_microbatches_on_the_first_stage_while_gpipe_holds_all_m(p, m):
    assert peak_in_flight(one_f_one_b(p, m)) == tuple(min(2 * (p - 1 - s) + 1, m)
                                                     for s in range(p))
    assert peak_in_flight(gpipe(p, m)) == (m,) * p


@pytest.mark.parametrize("p,m", SIZES)
def test_zero_bubble_holds_at_most_1f1bs_peak_on_any_stage(p, m):
    # Stage s keeps each microbatch s rounds longer (to its W), never past the first stage's.
    held = peak_in_flight(zero_bubble(p, m))
    assert held[0] == peak_in_flight(one_f_one_b(p, m))[0]
    assert max(held) == held[0]
    assert peak_weight_stash(zero_bubble(p, m)) == tuple(min(s, m) for s in range(p))
    assert peak_weight_stash(one_f_one_b(p, m)) == (0,) * p


@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_holds_more_chunks_than_1f1b_as_megatron_warns(p, m):
    first_stage = min(2 * (p - 1) + (V - 1) * p + 1, V * m)
    assert peak_in_flight(interleaved(p, m, V))[0] == first_stage


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (4, 32), (8, 16)])
def test_dualpipe_v_takes_the_least_ticks_its_v_allows_in_lockstep(p, m):
    # The device at the bottom of the V runs both its chunks of every microbatch, one forward
    # a round: the last forward leaves it p - 1 rounds before the loss. So 2m + 2(p-1) rounds with
    # a forward slot, as many with an I slot, 2m with a W slot; the greedy order reaches it.
    rounds = schedule_rounds("dualpipe_v", p, m, 2)
    assert sum("F" in s.kinds for s in rounds) == 2 * m + 2 * (p - 1)
    assert sum("I" in s.kinds for s in rounds) == 2 * m + 2 * (p - 1)
    assert sum("W" in s.kinds for s in rounds) == 2 * m
    table = dualpipe_v(p, m)
    validate(table, p, m, 2, "v")
    assert len(table) == 6 * m + 4 * (p - 1)
    assert bubble_fraction(table) == bubble_fraction(zero_bubble(p, m))
    assert bubble_fraction(table) < bubble_fraction(one_f_one_b(p, m))


def test_dualpipe_v_at_4_stages_and_16_microbatches_holds_less_than_1f1b_on_the_first_stage():
    table = dualpipe_v(4, 16)
    assert len(table) == 108 and float(bubble_fraction(table)) == pytest.approx(0.111, abs=1e-3)
    # In layer units (a chunk is 1/8 of the layers, a 1F1B stage 1/4): 11/8 against 7/4.
    held = peak_in_flight(table)
    assert held[0] == 11 and Fraction(held[0], 8) < Fraction(peak_in_flight(
        one_f_one_b(4, 16))[0], 4)
    # The V: the loss (the last chunk's forward) and the first chunk on the first device.
    last = [tick[0] for tick in table if tick[0] is not None and tick[0].chunk == 7]
    assert last and all(a.kind in "FIW" for a in last)
    assert {stage_of(c, 4, "v") for c in range(8)} == {0, 1, 2, 3}
    assert [stage_of(c, 4, "v") for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_dualpipe_v_runs_two_chunks_per_stage_only():
    with pytest.raises(ValueError, match="'dualpipe_v' runs two chunks per stage; v=1"):
        schedule_table("dualpipe_v", 2, 4, 1)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1),
                                    ("zero_bubble", 2), ("dualpipe_v", 2)])
def test_overlap_turns_the_last_chunk_back_a_round_later_at_no_cost_in_ticks(name, v):
    # A round's forward and backward in one layer loop (parallel.pipeline_overlap): no backward
    # reads its own round's forward, so the loss's backward waits a round; the stages run one
    # more forward ahead, and the ticks stay the same.
    p, m = 4, 16
    rounds = schedule_rounds(name, p, m, v, overlap=True)
    for rnd in rounds:
        for actions in rnd.actions:
            f, b = actions.get("F"), actions.get("B") or actions.get("I")
            assert f is None or b is None or (f.mb, f.chunk) != (b.mb, b.chunk)
    table = table_of(rounds)
    validate(table, p, m, v, placement_of(name))
    assert len(table) == len(schedule_table(name, p, m, v))
    held, before = peak_in_flight(table), peak_in_flight(schedule_table(name, p, m, v))
    assert held[0] <= before[0] + 1


def test_interleaved_rejects_microbatches_not_divisible_by_stages_in_one_line():
    with pytest.raises(ValueError, match=r"^interleaved schedule needs microbatches divisible by "
                       r"stages: m=6 is not divisible by p=4$"):
        interleaved(4, 6, 2)


def test_schedules_are_named_by_the_config_values_and_only_two_take_chunks():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zero_bubble", "dualpipe_v"}
    assert schedule_table("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert schedule_table("zero_bubble", 2, 4, v=2) == zero_bubble(2, 4, 2)
    with pytest.raises(ValueError, match="runs one chunk per stage; v=2"):
        schedule_table("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="'dualpipe' is not one of gpipe, 1f1b"):
        schedule_table("dualpipe", 2, 4)
    assert placement_of("dualpipe_v") == "v" and placement_of("interleaved") == "ring"


def test_validate_catches_a_backward_before_its_forward():
    table = one_f_one_b(2, 2)
    late = column(table, 1)
    assert late[1:4] == [Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 1)]
    late[1:4] = [Action("B", 0, 1), Action("B", 0, 1), Action("F", 0, 1)]
    with pytest.raises(ValueError, match=r"^B\(mb=0, chunk=1\) on stage 1 starts at tick 1 but "
                       r"needs its own forward F\(mb=0, chunk=1\) on stage 1, done only at tick 4"):
        validate(with_stage(table, 1, late), 2, 2)


def test_validate_catches_a_stage_running_ahead_of_its_upstream():
    table = gpipe(2, 4)
    early = column(table, 1)[1:]  # stage 1 starts every action one tick sooner
    with pytest.raises(ValueError, match=r"^F\(mb=0, chunk=1\) on stage 1 starts at tick 0 but "
                       r"needs its input from F\(mb=0, chunk=0\) on stage 0, done only at tick 1"):
        validate(with_stage(table, 1, early), 2, 4)


def test_validate_catches_a_missing_microbatch():
    table = [tuple(None if a is not None and a.mb == 3 else a for a in tick)
             for tick in one_f_one_b(4, 4)]
    with pytest.raises(ValueError, match=r"^F\(mb=3, chunk=0\) never runs \(stage 0\)$"):
        validate(table, 4, 4)


def test_validate_catches_a_gradient_sent_upstream_before_it_exists():
    # Stage 0's backward moved earlier, to before stage 1's backward of the same microbatch.
    table = gpipe(2, 1)
    assert render(table) == "stage 0: F0 .  .  .  B0 B0\nstage 1: .  F0 B0 B0 .  ."
    moved = with_stage(table, 0, [Action("F", 0, 0), None, None, Action("B", 0, 0),
                                  Action("B", 0, 0)])
    with pytest.raises(ValueError, match=r"B\(mb=0, chunk=0\) on stage 0 starts at tick 3 but "
                       r"needs its output gradient from B\(mb=0, chunk=1\) on stage 1, done only"
                       r" at tick 4"):
        validate(moved, 2, 1)


@pytest.mark.parametrize("broken,message", [
    (lambda t: [tick + (None,) for tick in t], r"^tick 0 has 3 entries, expected one per stage"),
    (lambda t: t[:2] + [t[2] + (None,)] + t[3:], r"^tick 2 has 3 entries, tick 0 has 2$"),
    (lambda t: [tuple(None if (i, s) == (3, 1) else a for s, a in enumerate(tick))
                for i, tick in enumerate(t)],
     r"^B\(mb=0, chunk=1\) on stage 1 at tick 2 lasts 1 tick\(s\); a B takes 2$"),
    (lambda t: [(tick[1], tick[0]) for tick in t],
     r"^F\(mb=0, chunk=0\) on stage 1 at tick 0: chunk 0 lives on stage 0$"),
    (lambda t: t + [(Action("F", 0, 0), None)], r"^F\(mb=0, chunk=0\) runs twice"),
    (lambda t: [tuple(None if a is not None and a.kind == "W" and a.mb == 1 else a
                      for a in tick) for tick in zero_bubble(2, 2)],
     r"^I\(mb=1, chunk=0\) has no matching W\(mb=1, chunk=0\) \(stage 0\)$"),
    (lambda t: [tuple(None if a is not None and a.kind == "B" else a for a in tick)
                for tick in t], r"^microbatch 0, chunk 0 has no backward"),
], ids=["wider-than-p", "ragged-tick", "B-in-one-tick", "wrong-stage", "forward-twice",
        "I-without-W", "no-backward"])
def test_validate_names_each_kind_of_broken_table(broken, message):
    with pytest.raises(ValueError, match=message):
        validate(broken(one_f_one_b(2, 2)), 2, 2)


def test_orders_that_wait_on_each_other_are_reported_as_a_deadlock():
    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ValueError, match=r"deadlock: stage 0 at B\(mb=0, chunk=0\), stage 1 at "
                       r"F\(mb=0, chunk=1\) wait forever"):
        as_soon_as_possible(orders)


def test_render_shows_one_row_per_stage_and_a_backward_in_both_its_ticks():
    # Round 1 is F+B on both stages: stage 0 has a masked B slot (ticks 2-3), then runs F1.
    assert render(one_f_one_b(2, 2)) == (
        "stage 0: F0 F1 .  .  .  B0 B0 B1 B1\n"
        "stage 1: .  F0 B0 B0 F1 B1 B1 .  .")
    # Zero bubble: round 1 is F+I (stage 0 idles one tick, not two), and stage 1's W's wait
    # for the rounds where stage 0 runs its I's.
    assert render(zero_bubble(2, 2)) == (
        "stage 0: F0 F1 .  .  I0 W0 I1 W1\n"
        "stage 1: .  F0 I0 F1 I1 W0 .  W1")


def test_render_names_the_chunk_of_an_interleaved_table_by_letter():
    # Stage 0 holds chunks 0 (a) and 2 (b); stage 1 holds chunks 1 (a) and 3 (b).
    assert render(interleaved(2, 2, 2)) == (
        "stage 0: F0a F1a F0b F1b .   .   .   B0b B0b B1b B1b B0a B0a B1a B1a\n"
        "stage 1: .   F0a F1a F0b B0b B0b F1b B1b B1b B0a B0a B1a B1a .   .")
