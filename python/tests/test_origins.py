"""The first-Inf / first-NaN rule and the chain, on hand-built op sequences (no training)."""

from amprobe_torch._origins import chain, first_nonfinite, origins
from amprobe_torch._records import OpRecord, VecRef, in_order

CLEAN = [4.0, 0.0, 0.0, 0.0]
INF = [4.0, 0.0, 1.0, 0.0]
NEG_INF = [4.0, 0.0, 0.0, 1.0]
NAN = [4.0, 1.0, 0.0, 0.0]


def op(i, preds=(), ext=(), eligible=True, masked=False, name="add", module="m", phase="forward"):
    return OpRecord(phase, name, module, (), (None, (4,)), VecRef("check", i), tuple(preds), tuple(ext),
                    eligible, masked, i, 0)


def test_the_first_inf_is_the_op_that_made_it_not_the_ones_that_carry_it():
    ops = [op(0), op(1, [0]), op(2, [1]), op(3, [2])]
    assert first_nonfinite(ops, [CLEAN, INF, INF, NAN], {}) == (1, 3)


def test_an_input_that_held_the_value_already_makes_no_origin():
    # op 1 reads an input no op made (ext 7), which held an infinity.
    ops = [op(0), op(1, [0], ext=[7])]
    assert first_nonfinite(ops, [CLEAN, INF], {7: INF}) == (None, None)
    assert first_nonfinite(ops, [CLEAN, INF], {7: CLEAN}) == (1, None)


def test_a_masked_ops_negative_infinity_is_not_an_overflow_but_a_positive_one_is():
    ops = [op(0, masked=True), op(1, [0], masked=True)]
    assert first_nonfinite(ops, [NEG_INF, NEG_INF], {}) == (None, None)
    assert first_nonfinite(ops, [NEG_INF, INF], {}) == (1, None)


def test_an_ineligible_op_is_never_an_origin_and_its_value_passes_on():
    # A constant the model made (T5's log(0) in its position buckets): the op after it
    # only carries the infinity on.
    ops = [op(0, eligible=False), op(1, [0])]
    assert first_nonfinite(ops, [INF, INF], {}) == (None, None)


def test_the_chain_follows_data_from_the_inf_to_the_nan_in_execution_order():
    #   0 -> 1(inf) -> 2 -> 4(nan);  1 -> 3 (a side branch, not on the path)
    ops = [op(0), op(1, [0]), op(2, [1]), op(3, [1]), op(4, [2, 0])]
    assert chain(ops, 1, 4) == [1, 2, 4]


def test_the_chain_is_the_origin_alone_where_the_nan_does_not_descend_from_the_inf():
    ops = [op(0), op(1), op(2, [0])]
    assert chain(ops, 1, 2) == [1, 2]
    assert chain(ops, 2, 1) == [1]
    assert chain(ops, 1, 1) == [1]
    assert chain(ops, None, 2) == [2]
    assert chain(ops, None, None) == []


def test_origins_names_the_ops_with_their_step_module_and_phase():
    ops = [op(0), op(1, [0], name="linear", module="enc.wo"), op(2, [1], name="mul", module="norm")]
    got = origins(ops, [CLEAN, INF, NAN], {}, step=3)
    assert got["first_inf"] == {"step": 3, "micro": 0, "phase": "forward", "op_index": 1, "op": "linear",
                                "module": "enc.wo", "forward_op": None}
    assert got["first_nan"]["module"] == "norm"
    assert [r["op_index"] for r in got["chain"]] == [1, 2]
    assert origins(ops, [CLEAN, CLEAN, CLEAN], {}, step=0) == {"first_inf": None, "first_nan": None, "chain": []}


def test_replayed_ops_go_before_the_live_op_of_their_index_with_predecessors_renumbered():
    live = [op(0), op(1, [0])]
    # A replayed forward op keyed where its call began (live index 1) and one reading it.
    replayed = [op(0)._replace(index=(1, 0, 1)), op(0)._replace(index=(1, 0, 2), preds=(2,))]
    got = in_order(live + replayed)
    assert [o.index for o in got] == [0, 1, 2, 3]
    assert got[1].vec == replayed[0].vec and got[2].preds == (1,)
    assert got[3].preds == (0,)
