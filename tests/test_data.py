"""Data: synthetic and reasoning-gym tasks, jsonl/parquet/verl loading with its errors, the
held-out split, and chat-template prompt ids with a tokenizer built offline."""

import json

import pytest

from jetrl.data import (
    DatasetError,
    PromptTooLongError,
    encode_prompts,
    load_records,
    reasoning_gym_records,
    save_records,
    split_eval,
    synthetic_split,
)


def _key(record):
    return record["prompt"][-1]["content"]


# ---------------------------------------------------------------- synthetic task


def test_synthetic_is_deterministic_disjoint_and_correct():
    train, held_out = synthetic_split(500, 100, seed=3, ops=("+", "-", "*"), max_operand=20)
    assert (train, held_out) == synthetic_split(500, 100, seed=3, ops=("+", "-", "*"), max_operand=20)
    assert synthetic_split(500, 100, seed=4, ops=("+", "-", "*"), max_operand=20)[1] != held_out
    assert len(train) == 500 and len(held_out) == 100
    # Disjoint, also up to swapping the operands of + and *.
    def canon(r):
        a, op, b = _key(r).removeprefix("What is ").removesuffix("?").split()
        return (op, *sorted((a, b))) if op in "+*" else (op, a, b)
    assert not {canon(r) for r in train} & {canon(r) for r in held_out}
    assert len({canon(r) for r in train}) == 500
    for r in train + held_out:
        a, op, b = _key(r).removeprefix("What is ").removesuffix("?").split()
        assert r["ground_truth"] == str(eval(f"{a} {op} {b}")) and r["task"] == "synthetic"


def test_synthetic_errors():
    with pytest.raises(ValueError, match="give only 66 distinct ones"):
        synthetic_split(60, 10, seed=0, max_operand=10)
    with pytest.raises(ValueError, match="subset of"):
        synthetic_split(1, 1, seed=0, ops=("/",))
    # a repeated operator would count its problems twice: 9000 + 1000 "fit" 5050 distinct sums, and held-out
    # problems would land in training
    with pytest.raises(ValueError, match="repeat an operator; list each once"):
        synthetic_split(9000, 1000, seed=0, ops=("+", "+"))


# ---------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_scorers_get_the_metadata_they_compare_against(tmp_path):
    """Records keep reasoning-gym's own metadata objects in memory (arc_agi's grids are tuples; JSON made them lists
    and the scorer gave its own gold answer 0.05) and are written JSON-safe; a sentence answer keeps its period."""
    pytest.importorskip("reasoning_gym")
    from jetrl.rewards import reasoning_gym_reward

    for task in ("arc_agi", "emoji_mystery"):
        records = reasoning_gym_records(task, 2, seed=0)
        golds = [r["ground_truth"] for r in records]
        rewards = reasoning_gym_reward([rf"\boxed{{{g}}}" for g in golds], ground_truth=golds,
                                       task=[task] * 2, metadata=[r["metadata"] for r in records])
        assert rewards == [1.0, 1.0], task
        save_records(records, tmp_path / f"{task}.jsonl")
        assert len(load_records(tmp_path / f"{task}.jsonl")) == 2
    with pytest.raises(ValueError, match=r"'graph_color' has no gold answers .*task.reward_funcs=\['reasoning_gym'\]"):
        reasoning_gym_records("graph_color", 2, seed=0)  # its scorer reads the metadata only


def test_a_reasoning_gym_task_without_gold_answers_trains_on_its_own_scorer(tmp_path):
    """graph_color has no gold answers: its scorer checks a coloring against the graph. With the reasoning-gym reward
    (and the format reward) its records keep ground_truth None, a valid coloring scores 1, and the held-out
    correctness uses the same scorer; with the math reward it is one error naming the fix, before any model loads."""
    pytest.importorskip("reasoning_gym")
    import json

    from jetrl.rewards import compute_rewards, correctness_func
    from jetrl.run.config import TaskConfig
    from jetrl.run.tasks import load_task

    options = {"source": "reasoning_gym", "name": "graph_color", "num_train": 6, "num_eval": 2}
    train, held_out = load_task(TaskConfig(**options, reward_funcs=["reasoning_gym", "format"]))
    assert len(train) == 6 and len(held_out) == 2
    assert all(r["ground_truth"] is None for r in train + held_out)
    answers = [rf"\boxed{{{json.dumps(r['metadata']['possible_answer'])}}}" for r in train]
    columns = {key: [r.get(key) for r in train] for key in ("ground_truth", "task", "metadata")}
    rewards = compute_rewards(["reasoning_gym"], answers, **columns)["reasoning_gym"]
    assert rewards == [1.0] * 6
    assert correctness_func(["reasoning_gym", "format"])(answers, **columns) == [1.0] * 6
    assert compute_rewards(["reasoning_gym"], ["no idea"] * 6, **columns)["reasoning_gym"] == [0.0] * 6
    save_records(train, tmp_path / "graph_color.jsonl")  # written JSON-safe (None stays null)
    assert json.loads((tmp_path / "graph_color.jsonl").read_text().splitlines()[0])["ground_truth"] is None
    with pytest.raises(ValueError, match="has no gold answers"):
        load_task(TaskConfig(**options, reward_funcs=["math"]))
    # the same records from a file: kept under the answer-free rewards (and still scored 1), refused under math
    file_task = {"source": "file", "path": str(tmp_path / "graph_color.jsonl"), "num_eval": 0}
    loaded, _ = load_task(TaskConfig(**file_task, reward_funcs=["reasoning_gym"]))
    columns = {key: [r.get(key) for r in loaded] for key in ("ground_truth", "task", "metadata")}
    assert compute_rewards(["reasoning_gym"], answers, **columns)["reasoning_gym"] == [1.0] * 6
    with pytest.raises(DatasetError, match=r"no gold answer.*task.reward_funcs=\['reasoning_gym'\]"):
        load_task(TaskConfig(**file_task, reward_funcs=["math"]))


@pytest.mark.parametrize("task", ["gsm_symbolic", "basic_arithmetic", "chain_sum"])
def test_reasoning_gym_records_agree_with_math_reward(task):
    pytest.importorskip("reasoning_gym")  # a test extra (pyproject), installed by CI; absent on the GPU machine
    from jetrl.rewards import compute_rewards
    from jetrl.rewards.rg import score_fn

    records = reasoning_gym_records(task, size=8, seed=1)
    assert records == reasoning_gym_records(task, size=8, seed=1)
    assert all(r["ground_truth"] and r["task"] == task for r in records)
    assert all(r["prompt"][-1]["content"].endswith("\\boxed{}.") for r in records)
    json.dumps(records)  # metadata is JSON-safe (gsm_symbolic carries Fractions)
    for r in records:
        assert score_fn(task)(r["ground_truth"], {"answer": r["ground_truth"], "metadata": r["metadata"]}) == 1.0
    columns = {k: [r[k] for r in records] for k in ("ground_truth", "task", "metadata")}
    right = [f"Working... so the answer is \\boxed{{{r['ground_truth']}}}." for r in records]
    wrong = [f"\\boxed{{{int(float(r['ground_truth'])) + 1}}}" for r in records]
    assert compute_rewards(["math", "reasoning_gym"], right, **columns) == {"math": [1.0] * 8, "reasoning_gym": [1.0] * 8}
    assert compute_rewards(["math"], wrong, **columns) == {"math": [0.0] * 8}
    if task == "gsm_symbolic":  # its chain of thought ends "#### <answer>"
        cot = [r["metadata"]["answer_cot"] for r in records]
        assert compute_rewards("math", cot, **columns)["math"] == [1.0] * 8


# ---------------------------------------------------------------- files


def test_jsonl_round_trip_and_plain_format(tmp_path):
    train, _ = synthetic_split(5, 0, seed=0)
    path = tmp_path / "synth.jsonl"
    save_records(train, path)
    assert load_records(path) == train
    plain = tmp_path / "gsm.jsonl"
    plain.write_text(json.dumps({"question": "Q?", "answer": "so #### 72"}) + "\n\n"
                     + json.dumps({"prompt": [{"role": "user", "content": "P"}], "ground_truth": 3}) + "\n")
    a, b = load_records(plain)
    assert a == {"prompt": [{"role": "user", "content": "Q?"}], "ground_truth": "so #### 72", "task": "gsm",
                 "answer": "so #### 72"}  # the file's columns stay, for the reward functions (TRL)
    assert b["ground_truth"] == "3"
    # MATH / NuminaMath / open-r1 name the prompt "problem"; TRL's message content may be a list of text parts
    other = tmp_path / "math.jsonl"
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]
    other.write_text(json.dumps({"problem": "1+1?", "solution": r"\boxed{2}"}) + "\n"
                     + json.dumps({"prompt": [{"role": "user", "content": parts}], "answer": "4"}) + "\n")
    c, d = load_records(other)
    assert c["prompt"] == [{"role": "user", "content": "1+1?"}] and c["ground_truth"] == r"\boxed{2}"
    assert d["prompt"] == [{"role": "user", "content": "What is 2+2?"}]
    other.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}],
                                 "answer": "4"}) + "\n")
    with pytest.raises(DatasetError, match="content part of type 'image_url'; only text parts"):
        load_records(other)


def test_dataset_columns_reach_the_rewards_and_round_trip(tmp_path):
    """A file's other columns stay in its records (JSON-safe) and come back as reward columns, None where a record
    lacks one; the names the reward call uses are refused; parquet keeps columns that only some rows have."""
    from jetrl.data.records import column_names, reward_columns

    path = tmp_path / "levels.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "2", "level": 1}) + "\n"
                    + json.dumps({"question": "2+2?", "answer": "4", "source": "x"}) + "\n")
    records = load_records(path)
    assert records[0]["level"] == 1 and "level" not in records[1] and records[1]["source"] == "x"
    columns = reward_columns(records, repeat=2)
    assert columns["level"] == [1, 1, None, None] and columns["source"] == [None, None, "x", "x"]
    assert columns["answer"] == ["2", "2", "4", "4"] and columns["ground_truth"] == ["2", "2", "4", "4"]
    assert columns["prompts"][2] == [{"role": "user", "content": "2+2?"}] and "question" not in columns
    pytest.importorskip("pyarrow")
    save_records(records, tmp_path / "levels.parquet")
    back = load_records(tmp_path / "levels.parquet")
    assert back[0]["level"] == 1 and back[1]["source"] == "x"
    assert reward_columns(back)["level"] == [1, None]
    mixed = [records[0], {**records[1], "level": "Level 4"}]  # an int and a str in one column
    with pytest.raises(DatasetError, match="parquet cannot hold these records' columns .*save them as .jsonl"):
        save_records(mixed, tmp_path / "mixed.parquet")
    path.write_text(json.dumps({"question": "1+1?", "answer": "2", "completions": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"levels.jsonl:1: column 'completions' cannot reach the reward functions"):
        load_records(path)
    # a batch without a column still passes it (the whole dataset's names), and completion_ids come along
    batch = reward_columns(records[1:], 1, column_names(records), completion_ids=[[7, 8]])
    assert batch["level"] == [None] and batch["completion_ids"] == [[7, 8]]
    with pytest.raises(ValueError, match="records hold a column 'prompts', a name the reward functions' call uses"):
        column_names([{**records[0], "prompts": "x"}])


VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"split": "train", "index": 0},
}
VERL_RECORD = {"prompt": VERL_ROW["prompt"], "ground_truth": "4", "task": "openai/gsm8k",
               **{k: VERL_ROW[k] for k in ("data_source", "ability", "reward_model", "extra_info")}}


def test_verl_format_jsonl(tmp_path):
    path = tmp_path / "verl.jsonl"
    path.write_text(json.dumps(VERL_ROW) + "\n")
    assert load_records(path) == [VERL_RECORD]


def test_parquet_round_trip_and_verl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = synthetic_split(4, 0, seed=0)[0]
    records[1] = {**records[1], "metadata": {"a": 1, "nested": {"b": [1, 2]}}}
    save_records(records, tmp_path / "r.parquet")
    assert load_records(tmp_path / "r.parquet") == records
    pq.write_table(pa.Table.from_pylist([VERL_ROW, VERL_ROW]), tmp_path / "verl.parquet")
    assert load_records(tmp_path / "verl.parquet") == [VERL_RECORD, VERL_RECORD]


@pytest.mark.parametrize("name,content,match", [
    ("empty.jsonl", "\n  \n", r"empty\.jsonl: dataset file is empty"),
    ("bad.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', r"bad\.jsonl:2: malformed JSON line"),
    ("list.jsonl", "[1, 2]\n", r"list\.jsonl:1: expected a JSON object, got list"),
    ("nogold.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r"nogold\.jsonl:2: record has no gold answer"),
    ("blankgold.jsonl", '{"prompt": "a", "answer": "  "}\n', r"blankgold\.jsonl:1: record has no gold answer"),
    ("noprompt.jsonl", '{"answer": "1"}\n', r"noprompt\.jsonl:1: record has no prompt"),
    ("badmsg.jsonl", '{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}\n',
     r"badmsg\.jsonl:1: .*role 'robot'"),
    ("dictgold.jsonl", '{"prompt": "a", "answer": {"v": 0}}\n',
     r"dictgold\.jsonl:1: .*gold answer \{'v': 0\} is a dict"),
    ("nangold.jsonl", '{"prompt": "a", "answer": NaN}\n', r"nangold\.jsonl:1: .*gold answer nan is a float"),
    ("data.csv", "prompt,answer\n", r"unsupported dataset format '\.csv'"),
    ("bad.parquet", "not parquet", r"bad\.parquet: cannot read parquet"),
])
def test_dataset_errors(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_records(tmp_path / name)


def test_missing_and_empty_parquet(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found: .*nope.jsonl"):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"latin1\.jsonl is not UTF-8 text .*write the dataset as UTF-8"):
        load_records(tmp_path / "latin1.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="empty.parquet: dataset file is empty"):
        load_records(tmp_path / "empty.parquet")


def test_a_glob_reads_a_splits_shards_and_a_directory_is_refused(tmp_path):
    """HF dataset repos shard a split (data/train-00000-of-00002.parquet, ...) next to the other splits' files: a
    glob reads the split's shards in name order; a directory, which would mix in the held-out split, is an error
    naming its files and the glob to give."""
    train, _ = synthetic_split(6, 0, seed=1)
    held_out, _ = synthetic_split(2, 0, seed=2)
    data = tmp_path / "data"
    data.mkdir()
    save_records(train[3:], data / "train-00001-of-00002.parquet")
    save_records(train[:3], data / "train-00000-of-00002.jsonl")
    save_records(held_out, data / "test-00000-of-00001.parquet")
    (data / "README.md").write_text("a dataset card")
    got = load_records(data / "train-*")
    assert [r["prompt"] for r in got] == [r["prompt"] for r in train]
    other = tmp_path / "other"
    other.mkdir()
    (other / "gsm-00000-of-00001.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n')
    assert load_records(other / "gsm-*.jsonl")[0]["task"] == "gsm"  # a shard's task: its stem, unnumbered
    assert [r["ground_truth"] for r in load_records(str(data / "test-*.parquet"))] == [r["ground_truth"]
                                                                                       for r in held_out]
    with pytest.raises(DatasetError, match=r"is a directory \(it holds test-00000-of-00001.parquet, train-00000-of-"
                                           r"00002.jsonl, train-00001-of-00002.parquet\): name one file, or a split's "
                                           r"shards with a glob, e.g. .*data/train-\*"):
        load_records(data)
    with pytest.raises(DatasetError, match=r"is a directory \(it holds data/test-00000-of-00001.parquet, .*e.g. "
                                           r".*/data/train-\*"):  # an HF repo's root: its shards sit in data/
        load_records(tmp_path)
    save_records(held_out, other / "gsm[1].jsonl")  # a file named like a glob is that file
    assert len(load_records(other / "gsm[1].jsonl")) == len(held_out)
    with pytest.raises(DatasetError, match="no dataset file matches .*validation-"):
        load_records(data / "validation-*.parquet")
    with pytest.raises(DatasetError, match=r"README.md: unsupported dataset format '.md'"):
        load_records(data / "*")


def test_split_eval():
    records = synthetic_split(50, 0, seed=0)[0]
    train, held_out = split_eval(records, 0.2, seed=1)
    assert len(held_out) == 10 and len(train) == 40
    assert (train, held_out) == split_eval(records, 0.2, seed=1)
    assert sorted(map(_key, train + held_out)) == sorted(map(_key, records))
    assert not set(map(_key, train)) & set(map(_key, held_out))
    assert [r for r in records if r in held_out] == held_out  # input order kept
    assert len(split_eval(records, 7)[1]) == 7
    for bad in (0, 50, 1.0, 0.0):
        with pytest.raises(ValueError, match="eval_size"):
            split_eval(records, bad)
    for bad in (True, "10"):
        with pytest.raises(TypeError, match="eval_size"):
            split_eval(records, bad)
    # a problem that repeats (generators repeat easy ones) is held out whole and once: never trained on
    repeated = records[:5] * 3 + records[5:8]
    train, held_out = split_eval(repeated, 3, seed=0)
    assert len(held_out) == 3 and len(set(map(_key, held_out))) == 3
    assert not set(map(_key, train)) & set(map(_key, held_out))
    assert len(train) == len(repeated) - sum(_key(r) in set(map(_key, held_out)) for r in repeated)
    with pytest.raises(ValueError, match="holds out 8 of 8 distinct problems \\(18 records\\)"):
        split_eval(repeated, 8)


def test_a_file_task_counts_problems_not_records(tmp_path):
    """Records that share a prompt are one problem: a file of 50 copies of one prompt cannot hold out 2, and the
    error says so in the config's terms (not split_eval's)."""
    from jetrl.run.config import TaskConfig
    from jetrl.run.tasks import load_task

    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n' * 50)
    with pytest.raises(DatasetError, match=r"dup\.jsonl has 1 distinct prompt\(s\) in 50 records; task.num_eval=2 "
                                           "leaves none to train on: lower task.num_eval or give task.eval_path"):
        load_task(TaskConfig(source="file", path=str(path), num_eval=2))


# ---------------------------------------------------------------- chat template


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A 256-token byte-level tokenizer with a tiny chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template)


def test_encode_prompts_with_chat_template(byte_tokenizer):
    train, _ = synthetic_split(3, 0, seed=0)
    ids = encode_prompts(train, byte_tokenizer)
    assert byte_tokenizer.decode(ids[0]) == f"<user>{_key(train[0])}\n<assistant>"
    with_system = encode_prompts(train, byte_tokenizer, system_prompt="Answer.")
    assert byte_tokenizer.decode(with_system[0]) == f"<system>Answer.\n<user>{_key(train[0])}\n<assistant>"
    verl = [{**VERL_RECORD}]  # its own system message wins over the configured one
    text = byte_tokenizer.decode(encode_prompts(verl, byte_tokenizer, system_prompt="X")[0])
    assert text.startswith("<system>Be brief.\n<user>2+2?")
    # a record built in Python with a plain-string prompt (TRL's standard format) is one user message
    plain = encode_prompts([{"prompt": "2+2?", "ground_truth": "4"}], byte_tokenizer)[0]
    assert byte_tokenizer.decode(plain) == "<user>2+2?\n<assistant>"
    # grpo.chat_template_kwargs reach the template (Qwen3's enable_thinking=False writes an empty think block)
    byte_tokenizer.chat_template += ("{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                                     "{% endif %}")
    record = [{"prompt": "2+2?", "ground_truth": "4"}]
    assert byte_tokenizer.decode(encode_prompts(record, byte_tokenizer)[0]) == "<user>2+2?\n<assistant>"
    quiet = encode_prompts(record, byte_tokenizer, template_kwargs={"enable_thinking": False})[0]
    assert byte_tokenizer.decode(quiet) == "<user>2+2?\n<assistant><think></think>"


def test_prompt_too_long_names_record_and_lengths(byte_tokenizer):
    records = synthetic_split(3, 0, seed=0)[0] + [VERL_RECORD]
    lengths = [len(ids) for ids in encode_prompts(records, byte_tokenizer)]
    limit = max(lengths[:3])
    assert lengths[3] > limit
    with pytest.raises(PromptTooLongError, match=rf"prompt of record 3 is {lengths[3]} tokens, longer than "
                                                 rf"max_prompt_length={limit}"):
        encode_prompts(records, byte_tokenizer, max_prompt_length=limit)


def test_tokenizer_without_chat_template(byte_tokenizer):
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="has no chat_template"):
        encode_prompts(synthetic_split(1, 0, seed=0)[0], plain)
