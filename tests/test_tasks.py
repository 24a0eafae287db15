"""Tasks tier: the arithmetic generator and demonstrator, the task pool, dataset loading errors."""

import json
import random

import pytest

from tamer.tasks import ArithmeticConfig, ArithmeticTasks, DatasetConfig, DatasetError, DatasetTasks, TaskPool
from tamer.tasks.arithmetic import solve, work_columns
from tamer.tasks.base import extract_answer, is_correct, normalize_answer


@pytest.mark.parametrize("ops", ["+", "-", "*"])
def test_column_work_without_slips_is_exact(ops):
    src = ArithmeticTasks(ArithmeticConfig(operations=ops))
    train, held = src.split()
    for task in train[:500] + held:
        m = task.meta
        assert (work_columns(m["a"], m["b"], m["op"], [False] * 3)[1] == solve(m["a"], m["b"], m["op"])
                == int(task.answer))


def test_demonstration_format_and_slip():
    src = ArithmeticTasks(ArithmeticConfig(operations="+", demo_slip_rate=1.0))
    task = src._problem(47, 38, "+")
    assert task.meta["carry_columns"] == [1]
    assert src.demonstrate(task, random.Random(0)) == "<think>7+8=15 4+3=7</think><answer>75</answer>"
    perfect = ArithmeticTasks(ArithmeticConfig(operations="+", demo_slip_rate=0.0))
    assert perfect.demonstrate(task, random.Random(0)) == "<think>7+8=15 4+3+1=8</think><answer>85</answer>"


def test_demonstrator_is_imperfect_but_mostly_right():
    src = ArithmeticTasks()
    _, held = src.split()
    rng = random.Random(0)
    acc = sum(is_correct(src.demonstrate(t, rng), t) for t in held) / len(held)
    assert 0.6 < acc < 0.9


def test_split_is_disjoint_and_deterministic():
    a_train, a_held = ArithmeticTasks().split()
    b_train, b_held = ArithmeticTasks().split()
    assert [t.id for t in a_held] == [t.id for t in b_held]
    assert not {t.id for t in a_train} & {t.id for t in a_held}
    assert len(a_held) == 400


def test_bad_arithmetic_config_names_field():
    with pytest.raises(ValueError, match="^operations: use characters"):
        ArithmeticConfig(operations="/")


def test_answer_extraction_and_normalization():
    assert extract_answer("x<answer> 1,024 </answer>y<answer>7</answer>") == "7"
    assert extract_answer("no answer") is None
    assert normalize_answer("1,024") == normalize_answer("1024.0") == "1024"
    assert normalize_answer("  Paris ") == "paris"


def test_task_pool_is_seeded_and_resumable():
    tasks, _ = ArithmeticTasks().split()
    pool = TaskPool(tasks[:10], seed=1)
    first = [t.id for t in pool.next_batch(7)]
    state = pool.state_dict()
    rest = [t.id for t in pool.next_batch(8)]  # crosses an epoch boundary
    resumed = TaskPool(tasks[:10], seed=1)
    resumed.load_state_dict(state)
    assert [t.id for t in resumed.next_batch(8)] == rest
    assert len(set(first)) == 7  # no repeats within an epoch


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_dataset_jsonl_loads_and_splits(tmp_path):
    rows = [{"q": f"What is {i}+1?", "a": i + 1} for i in range(20)]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    src = DatasetTasks(DatasetConfig(path=str(path), prompt_column="q", answer_column="a", heldout_fraction=0.25))
    train, held = src.split()
    assert len(train) == 15 and len(held) == 5
    assert not {t.id for t in train} & {t.id for t in held}
    assert src.demonstrate(held[0], random.Random(0)) == f"<answer>{held[0].answer}</answer>"


def test_dataset_parquet_loads(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(10)], "answer": [str(i) for i in range(10)]}), path)
    train, held = DatasetTasks(DatasetConfig(path=str(path))).split()
    assert len(train) + len(held) == 10


def test_malformed_json_row_names_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer": ',
                                                 {"prompt": "c", "answer": "3"}])
    with pytest.raises(DatasetError, match=r"bad.jsonl, row 2: invalid JSON"):
        DatasetTasks(DatasetConfig(path=str(path))).split()


def test_missing_column_names_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "gap.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"},
                                                 {"prompt": "c"}])
    with pytest.raises(DatasetError, match=r"gap.jsonl, row 3: missing or empty column 'answer'"):
        DatasetTasks(DatasetConfig(path=str(path))).split()


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        DatasetTasks(DatasetConfig(path=str(tmp_path / "nope.jsonl"))).split()
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match="unsupported file type"):
        DatasetTasks(DatasetConfig(path=str(tmp_path / "x.txt"))).split()
