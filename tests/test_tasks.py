"""Built-in tasks, the task-file loader, fingerprints and checksums (all on CPU, a few seconds)."""

import math
import textwrap
from pathlib import Path

import pytest
import torch

from p2ptrain.errors import ConfigError
from p2ptrain.tasks import (Task, fingerprint_diff, load_task, model_fingerprint, param_checksum,
                            parse_model_size, validate_task)

CPU = torch.device("cpu")
TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "task_template.py"


def train(task, steps, lr, rank_seed=0):
    optimizer = task.make_optimizer(task.model.parameters(), lr)
    batches = task.train_batches(rank_seed, 1, task.batch_size, 0)
    losses = []
    for _ in range(steps):
        loss = task.loss(task.model, next(batches), CPU)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5


@pytest.fixture(scope="module")
def tiny_charlm():
    return load_task("charlm", {"model_size": "tiny", "batch_size": 16})


# ---- built-ins ----

def test_default_is_charlm_on_the_stdlib():
    task = load_task(None, {})
    assert task.name == "charlm" and task.source == "built-in task charlm" and task.batch_size == 32
    assert 300_000 <= task.num_parameters() <= 1_000_000
    assert "standard library" in task.info and f"{task.num_parameters():,} parameters" in task.info


def test_charlm_validates_and_learns(tiny_charlm):
    validate_task(tiny_charlm, CPU)
    first, last = train(tiny_charlm, 40, 3e-3)
    assert first > 4.5 and last < first - 1.0, (first, last)


def test_synthetic_validates_and_learns():
    task = load_task("synthetic", {"model_size": "100k"})
    assert abs(task.num_parameters() - 100_000) < 20_000 and "100,015 parameters" in task.info
    validate_task(task, CPU)
    first, last = train(task, 60, task.default_lr)
    assert last < first - 0.5, (first, last)
    assert "accuracy" in task.sample(task.model, CPU)


def test_synthetic_refuses_data_it_would_ignore():
    with pytest.raises(ConfigError, match="synthetic: --data notes.txt: this task makes its own data"):
        load_task("synthetic", {"data": "notes.txt"})


@pytest.mark.parametrize("name", ["charlm", "synthetic"])
def test_batches_are_seeded_per_peer(name):
    task = load_task(name, {"model_size": "tiny" if name == "charlm" else "10k", "batch_size": 8})

    def first_batch(rank_seed, seed):
        return next(task.train_batches(rank_seed, 2, 8, seed))

    same_a, same_b = first_batch(1, 0), first_batch(1, 0)
    assert all(torch.equal(a, b) for a, b in zip(same_a, same_b))
    assert not torch.equal(first_batch(1, 0)[0], first_batch(2, 0)[0])
    assert not torch.equal(first_batch(1, 0)[0], first_batch(1, 5)[0])
    assert task.batch_size_of(same_a) == 8


def test_evaluate_and_sample_are_deterministic(tiny_charlm):
    twin = load_task("charlm", {"model_size": "tiny"})
    twin.model.load_state_dict(tiny_charlm.model.state_dict())
    rng_before = torch.get_rng_state()
    value = tiny_charlm.evaluate(tiny_charlm.model, CPU)
    assert math.isfinite(value) and value == tiny_charlm.evaluate(tiny_charlm.model, CPU)
    assert value == twin.evaluate(twin.model, CPU)  # held-out windows are the same on every peer
    text = tiny_charlm.sample(tiny_charlm.model, CPU)
    assert text.startswith("def ") and len(text) > 100 and text == twin.sample(twin.model, CPU)
    assert torch.equal(rng_before, torch.get_rng_state())  # the global RNG is left alone
    assert tiny_charlm.model.training


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = load_task("synthetic", {"model_size": "10k"}), load_task("synthetic", {"model_size": "10k"})
    c = load_task("synthetic", {"model_size": "10k", "seed": 1})
    assert param_checksum(a.model) == param_checksum(b.model) != param_checksum(c.model)


def test_charlm_data_option(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("hello world, " * 400)
    (folder / "b.bin").write_bytes(b"\0\1\2" * 100)  # binary files in a folder are skipped
    task = load_task("charlm", {"model_size": "tiny", "data": str(folder)})
    assert "5,200 bytes" in task.info
    validate_task(task, CPU)
    with pytest.raises(ConfigError, match="--data .*no such file or folder"):
        load_task("charlm", {"data": str(tmp_path / "missing.txt")})
    with pytest.raises(ConfigError, match="b.bin: not a text file"):  # (it trained on the bytes of a binary)
        load_task("charlm", {"data": str(folder / "b.bin")})
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ConfigError, match="too little.*at least"):
        load_task("charlm", {"data": str(tmp_path / "short.txt")})


@pytest.mark.parametrize("text, count", [("100k", 100_000), ("1m", 10 ** 6), ("10M", 10 ** 7), ("100m", 10 ** 8),
                                         ("1.5m", 1_500_000), ("250000", 250_000), (4096, 4096), ("1e6", 10 ** 6),
                                         ("2b", 2 * 10 ** 9)])
def test_parse_model_size(text, count):
    assert parse_model_size(text) == count


@pytest.mark.parametrize("text", ["12x", "-5", "", "0", "k", "1mm", "nan"])
def test_parse_model_size_rejects(text):
    with pytest.raises(ConfigError, match="--model-size .*use e.g. 100k"):
        parse_model_size(text)


@pytest.mark.parametrize("size", ["100k", "1m"])
def test_model_size_gives_about_that_many_parameters(size):
    task = load_task("synthetic", {"model_size": size})
    assert abs(task.num_parameters() / parse_model_size(size) - 1) < 0.2


def test_options_are_checked_and_batch_size_applied():
    assert load_task("synthetic", {"model_size": "10k", "batch_size": 7}).batch_size == 7
    with pytest.raises(ConfigError, match="--seed"):
        load_task("synthetic", {"seed": "x"})
    with pytest.raises(ConfigError, match="--batch-size"):
        load_task("synthetic", {"batch_size": 0})
    with pytest.raises(ConfigError, match="--model-size "):
        load_task("charlm", {"model_size": "huge"})


# ---- fingerprints and checksums ----

def test_fingerprint_diff_names_the_first_difference():
    small = load_task("synthetic", {"model_size": "100k"}).model
    smaller = load_task("synthetic", {"model_size": "10k"}).model
    here = model_fingerprint(small)
    assert here[0] == ("0.weight", (295, 32), "float32", True)
    assert fingerprint_diff(here, model_fingerprint(small)) is None
    as_sent = [[name, list(shape), dtype, trainable] for name, shape, dtype, trainable in here]  # (msgpack's)
    assert fingerprint_diff(here, as_sent) is None
    old_checkpoints = [[name, list(shape), dtype] for name, shape, dtype, _ in here]  # (trainable not said)
    assert fingerprint_diff(here, old_checkpoints) is None
    small[0].weight.requires_grad_(False)
    assert fingerprint_diff(here, model_fingerprint(small)) == \
        "parameter '0.weight' is trained here and frozen on the other peer (requires_grad): freeze the same " \
        "parameters on every peer"
    small[0].weight.requires_grad_(True)
    assert fingerprint_diff(here, model_fingerprint(smaller)) == \
        "another size: 100,015 parameters here, 9,930 on the other peer; " \
        "parameter '0.weight' has shape (295, 32) here and (80, 32) on the other peer"
    assert fingerprint_diff(here, model_fingerprint(small.half())) == \
        "parameter '0.weight' has dtype float32 here and float16 on the other peer"
    assert fingerprint_diff(here, here[:-1]).endswith("; parameter '4.bias' exists here but not on the other peer")
    assert fingerprint_diff(here[:-1], here).endswith("; parameter '4.bias' exists on the other peer but not here")
    renamed = [("extra.weight", (295, 32), "float32", True)] + here[1:]  # (the same size: no sizes said)
    assert fingerprint_diff(here, renamed) == "parameter '0.weight' exists here but not on the other peer"
    assert fingerprint_diff(renamed, here) == "parameter 'extra.weight' exists here but not on the other peer"
    swapped = [here[1], here[0]] + here[2:]
    assert "different order" in fingerprint_diff(here, swapped)
    assert fingerprint_diff(here, [["0.weight", "295x32", "float32"]]) == \
        "the other peer's model fingerprint is malformed"
    assert fingerprint_diff(here, None) == "the other peer's model fingerprint is malformed"


def test_param_checksum_sees_one_ulp():
    a = load_task("synthetic", {"model_size": "10k"}).model
    b = load_task("synthetic", {"model_size": "10k"}).model
    assert param_checksum(a) == param_checksum(b)
    assert len(param_checksum(a)) == 32 and int(param_checksum(a), 16) >= 0
    with torch.no_grad():
        weight = b[2].weight
        weight[3, 4] = torch.nextafter(weight[3, 4], torch.tensor(math.inf))
    assert param_checksum(a) != param_checksum(b)
    with torch.no_grad():
        b[2].weight.copy_(a[2].weight)
    assert param_checksum(a) == param_checksum(b)
    assert param_checksum(a.bfloat16()) != param_checksum(b)  # dtype counts; bfloat16 hashes fine


def test_validate_task_refuses_what_is_not_a_task():
    with pytest.raises(ConfigError, match="got dict, not p2ptrain.tasks.Task"):
        validate_task({"name": "x"}, CPU)


def test_validate_task_leaves_the_model_unchanged(tiny_charlm):
    before = param_checksum(tiny_charlm.model)
    validate_task(tiny_charlm, CPU)
    assert param_checksum(tiny_charlm.model) == before
    assert all(p.grad is None for p in tiny_charlm.model.parameters())


# ---- task files ----

def test_template_loads_validates_and_learns():
    task = load_task(str(TEMPLATE), {"seed": 3, "batch_size": 32})
    assert isinstance(task, Task) and task.name == "spirals" and task.source == str(TEMPLATE)
    assert task.batch_size == 32
    validate_task(task, CPU)
    first, last = train(task, 60, task.default_lr)
    assert last < first - 0.2, (first, last)


GOOD_TASK = """
import torch
from p2ptrain.tasks import Task

def make_task(options):
    model = torch.nn.Linear(4, 1)
    def batches(rank_seed, world_hint, batch_size, seed):
        gen = torch.Generator().manual_seed(seed * 1000 + rank_seed)
        while True:
            x = torch.randn(batch_size, 4, generator=gen)
            yield x, x.sum(dim=1, keepdim=True)
    def loss(model, batch, device):
        x, y = (t.to(device) for t in batch)
        return LOSS
    return Task(name="lin", model=model, make_optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr),
                default_lr=0.1, train_batches=batches, loss=loss, batch_size=8)
"""
SCALAR_LOSS = "((model(x) - y) ** 2).mean()"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def one_line_error(spec, options=None, validate=False):
    with pytest.raises(ConfigError) as info:
        task = load_task(spec, options or {})
        if validate:
            validate_task(task, CPU)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_good_task_file(tmp_path):
    path = write(tmp_path, "good.py", GOOD_TASK.replace("LOSS", SCALAR_LOSS))
    task = load_task(path, {})
    validate_task(task, CPU)
    assert task.batch_size_of(next(task.train_batches(0, 1, 8, 0))) == 8  # the default batch_size_of


def test_task_file_errors_are_one_line(tmp_path):
    syntax = write(tmp_path, "syntax.py", "def make_task(options)\n    return 1\n")
    message = one_line_error(syntax)
    assert message.startswith(f"{syntax}: failed to import: SyntaxError") and "line 1" in message

    boom = write(tmp_path, "boom.py", "raise RuntimeError('no GPU here')\n")
    assert one_line_error(boom).startswith(f"{boom}: failed to import: RuntimeError: no GPU here")

    empty = write(tmp_path, "bad.py", "x = 1\n")
    assert one_line_error(empty) == (f"{empty}: no make_task(options) function: define make_task returning "
                                     f"p2ptrain.tasks.Task (see examples/task_template.py)")

    wrong = write(tmp_path, "wrong.py", "def make_task(options):\n    return {'model': None}\n")
    assert one_line_error(wrong).startswith(f"{wrong}: make_task(options) returned dict, not p2ptrain.tasks.Task")

    raises = write(tmp_path, "raises.py", "def make_task(options):\n    return options['nope']\n")
    assert one_line_error(raises) == f"{raises}: make_task(options) raised KeyError: 'nope'; fix make_task"

    not_scalar = write(tmp_path, "vector.py", GOOD_TASK.replace("LOSS", "((model(x) - y) ** 2).squeeze(1)"))
    assert one_line_error(not_scalar, validate=True) == (
        f"{not_scalar}: loss(model, batch, device) returned a tensor of shape (8,): return a scalar "
        f"(e.g. reduce with .mean()) (see examples/task_template.py)")

    detached = write(tmp_path, "detached.py", GOOD_TASK.replace("LOSS", "torch.tensor(1.0)"))
    assert "without a graph" in one_line_error(detached, validate=True)

    listed = write(tmp_path, "listed.py", GOOD_TASK.replace("LOSS", SCALAR_LOSS)
                   .replace("train_batches=batches", "train_batches=lambda *a: [1, 2]"))
    assert "train_batches(...) returned list, not an iterator" in one_line_error(listed, validate=True)

    crash = write(tmp_path, "crash.py", GOOD_TASK.replace("LOSS", "model(x[:, :3]).mean()"))
    message = one_line_error(crash, validate=True)
    assert message.startswith(f"{crash}: loss(model, batch, device) raised RuntimeError: ")

    # torch's allocation failure (its text, on CPU) is the batch's size, not a bug to fix in the task
    short = write(tmp_path, "short.py", GOOD_TASK.replace(
        "LOSS", "(_ for _ in ()).throw(RuntimeError(\"DefaultCPUAllocator: can't allocate memory: you tried\"))"))
    assert one_line_error(short, validate=True).endswith("): give a smaller --batch-size")


def test_module_function_form(tmp_path, monkeypatch):
    write(tmp_path, "my_tasks_mod.py", GOOD_TASK.replace("LOSS", SCALAR_LOSS).replace("make_task", "build"))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("my_tasks_mod:build", {"batch_size": 4})
    assert task.name == "lin" and task.source == "my_tasks_mod:build" and task.batch_size == 4
    validate_task(task, CPU)
    assert "has no 'make_task'" in one_line_error("my_tasks_mod:make_task")
    assert "cannot import module 'no_such_module_xyz'" in one_line_error("no_such_module_xyz:make_task")


@pytest.mark.parametrize("spec, fragment", [("nope", "not a built-in (charlm, synthetic)"),
                                            ("missing/task.py", "no such file")])
def test_unknown_specs(spec, fragment):
    assert fragment in one_line_error(spec)


def test_printable_text_escapes_what_would_drive_a_terminal():
    from p2ptrain.tasks import printable_text

    assert printable_text("def f():\n\treturn 1") == "def f():\n\treturn 1"
    assert printable_text("a\x1b[2Jb\x00c\x85d\x7f") == "a\\x1b[2Jb\\x00c\\x85d\\x7f"
    assert printable_text("caf\u00e9 \u2603") == "caf\u00e9 \u2603"  # printable non-ASCII stays


def test_an_untrained_charlm_samples_printable_text(tiny_charlm):
    """An untrained model samples any byte: none reaches the terminal raw (ESC, C1 controls),
    and bytes that are not UTF-8 show as \\xNN, not as U+FFFD."""
    import copy

    model, g = copy.deepcopy(tiny_charlm.model), torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():  # (random weights: every byte about as likely)
            p.normal_(0, 1, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (200 tiny forwards: torch's thread pool only spins on a busy machine)
    try:
        text = tiny_charlm.sample(model, CPU)
    finally:
        torch.set_num_threads(threads)
    assert all(c.isprintable() or c in "\n\t" for c in text), [c for c in text if not c.isprintable()][:5]
    assert "\ufffd" not in text and "\\x" in text
