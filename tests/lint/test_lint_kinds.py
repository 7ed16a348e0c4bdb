"""The kinds issue 45 named, on new code written for these tests: reads hidden in formatting
and logging, evaluation not named like evaluation, and the look-alikes that must stay quiet
(a rare empty_cache, a forward that runs once)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from loopkit import lint

HEAD = """\
import math

import torch
import wandb
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

device = "cuda"
model = torch.nn.Linear(8, 1).to(device)
opt = torch.optim.AdamW(model.parameters())
writer = SummaryWriter()
"""


def _codes(body: str, *, head: str = HEAD) -> list[tuple[int, str]]:
    """(line within ``body``, code) of every finding, every rule on."""
    source = head + textwrap.dedent(body)
    offset = head.count("\n")
    found = lint.check_source(source, "train.py", select=list(lint.RULES))
    return sorted((f.line - offset, f.code) for f in found if f.line > offset)


STEP = """\
bar = tqdm(loader)
for step, (x, y) in enumerate(bar):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    {line}
"""


@pytest.mark.parametrize(
    "line",
    [
        'bar.set_description(f"loss {loss:.4f}")',
        'print(f"step {step} loss {loss}")',
        'wandb.log({"loss": loss, "step": step})',
        'writer.add_scalar("train/loss", loss, step)',
        "perplexity = float(torch.exp(loss))",
        "perplexity = math.exp(loss)",
    ],
)
def test_a_loss_read_hidden_in_formatting_or_logging_is_found(line: str) -> None:
    """Each of these turns the loss tensor into a Python number every step: LK016 there."""
    assert _codes(STEP.format(line=line)) == [(7, "LK016")]


@pytest.mark.parametrize(
    "line",
    [
        'bar.set_description(f"loss {loss.item():.4f}")',  # explicit: LK002's
        "if step % 100 == 0: wandb.log({'loss': loss})",  # once per 100 steps
        'logger.log(10, "step done")',  # a logger, not a tracker
        'print(f"step {step}")',  # no tensor in it
        "value = math.exp(step / 100)",
    ],
)
def test_look_alikes_of_hidden_reads_are_not_lk016(line: str) -> None:
    """An explicit read is LK002's, a cadence is cheap, a logger or a host value reads nothing."""
    assert (7, "LK016") not in _codes(STEP.format(line=line))


def test_hidden_reads_cost_nothing_on_a_cpu_only_script() -> None:
    """The same loop in a script that never names a device: nothing to wait for."""
    head = "import torch\nimport wandb\nmodel = torch.nn.Linear(8, 1)\nopt = None\n\n\n\n\n\n\n\n"
    body = STEP.format(line='wandb.log({"loss": loss})').replace(".to(device)", "")
    assert _codes(body.replace("bar = tqdm(loader)", "bar = loader"), head=head) == []


PERIODIC_EVAL = """\
for step, (x, y) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 500 == 0:
        model.eval()
        with torch.no_grad():
            total = 0.0
            for xv, yv in val_loader:
                total += torch.nn.functional.mse_loss(model(xv.to(device)), yv.to(device)).item()
        model.train()
"""


def test_an_evaluation_loop_inside_the_training_loop_is_found_per_batch() -> None:
    """Every 500 steps an evaluation reads each of its batches: LK014 at the read (LK002
    leaves it: the evaluation itself runs once per 500 steps)."""
    assert _codes(PERIODIC_EVAL) == [(11, "LK014")]


def test_an_inner_loop_run_every_step_stays_lk002s() -> None:
    """The same inner loop without the cadence runs every step: LK002, not LK014 too."""
    body = PERIODIC_EVAL.replace("    if step % 500 == 0:\n", "    if True:\n")
    assert [c for _, c in _codes(body)] == ["LK002"]


METRICS = """\
def {name}(model, loader):
    model.eval()
    correct = 0
    for x, y in loader:
        pred = model(x.to(device)).argmax(1)
        correct += (pred == y.to(device)).sum().item()
    model.train()
    return correct


for epoch in range(10):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    print({name}(model, val_loader))
"""


@pytest.mark.parametrize("name", ["metrics", "accuracy", "score"])
def test_an_evaluation_function_named_otherwise_is_found(name: str) -> None:
    """A function that puts the model in eval mode and loops over a loader evaluates, per
    epoch here, whatever its name: its per-batch read is LK014 (and its autograd LK008)."""
    assert _codes(METRICS.format(name=name)) == [(5, "LK008"), (6, "LK014")]


def test_an_evaluation_function_called_once_after_training_is_quiet() -> None:
    """The same function called once, after training: its reads and graphs happen once."""
    once = (
        METRICS.format(name="metrics").replace("    print(metrics(model, val_loader))\n", "")
        + "print(metrics(model, test_loader))\n"
    )
    assert _codes(once) == []


def test_empty_cache_under_a_rare_cadence_is_quiet() -> None:
    """``if step % 1000 == 0: torch.cuda.empty_cache()`` is a rare release; every step is LK003."""
    body = STEP.format(line="if step % 1000 == 0:\n        torch.cuda.empty_cache()")
    assert _codes(body) == []
    assert _codes(STEP.format(line="torch.cuda.empty_cache()")) == [(7, "LK003")]


def test_a_forward_that_runs_once_after_eval_is_not_lk008() -> None:
    """A model summary at start-up and one test pass after training record graphs once."""
    body = """\
    model.eval()
    print(model(torch.zeros(1, 8, device=device)).shape)  # a summary at start-up
    model.train()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    for x, y in test_loader:
        out = model(x.to(device))
    """
    assert _codes(body) == []
    per_epoch = """\
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        for x, y in val_loader:
            out = model(x.to(device))
        model.train()
    """
    assert _codes(per_epoch) == [(9, "LK008")]


def test_numpy_of_a_batch_still_on_the_host_is_not_a_read() -> None:
    """``.numpy()`` raises on a device tensor: ``y.numpy()`` of ``y = batch["y"]`` reads a host
    batch (no finding); ``out.cpu().numpy()`` is a read, found at its ``.cpu()``."""
    body = """\
    for step, batch in enumerate(loader):
        x, y = batch["x"], batch["y"]
        weights = np.bincount(y.numpy())
        out = model(x.to(device))
        loss = (out - y.to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        {line}
    """
    head = HEAD.replace("import math\n", "import math\n\nimport numpy as np\n")
    assert _codes(body.format(line="pass"), head=head) == []
    assert _codes(body.format(line="kept = out.detach().cpu().numpy()"), head=head) == [
        (9, "LK002")
    ]


DEFAULT_DEVICE = """\
import torch

{default}


def composite(raw, z):
    far = torch.Tensor([1e10]).expand(z[..., :1].shape)
    return raw * torch.cat([z[..., 1:] - z[..., :-1], far], -1)


for step in range(1000):
    loss = composite(model(batch), z).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(
    "default",
    ['torch.set_default_tensor_type("torch.cuda.FloatTensor")', 'torch.set_default_device("cuda")'],
)
def test_host_data_becomes_a_device_tensor_under_a_cuda_default(default: str) -> None:
    """With new tensors on the GPU by default, ``torch.Tensor([1e10])`` copies host data to the
    device at every call: LK004 in the function the step calls; without the default, none."""
    found = lint.check_source(DEFAULT_DEVICE.format(default=default), "run.py")
    assert [(f.line, f.code) for f in found] == [(7, "LK004")]
    assert "reached from run.py:12" in found[0].message
    assert lint.check_source(DEFAULT_DEVICE.format(default="pass"), "run.py") == []


def test_a_tensor_made_from_numpy_and_moved_lines_later_is_found() -> None:
    """``torch.from_numpy(np.ones(...))``, reshaped, then moved two lines later: a host build
    copied each step (LK004); ``torch.from_numpy`` of the loader's array is its way in."""
    body = """\
    for step, (arr, y) in enumerate(loader):
        mask = torch.from_numpy(np.ones((4, 4), dtype=np.float32))
        mask = mask.unsqueeze(0).float()
        data = torch.from_numpy(arr)
        out = model(data.to(device)) * mask.to(device)
        loss = (out - y.to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
    head = HEAD.replace("import math\n", "import math\n\nimport numpy as np\n")
    found = lint.check_source(head + textwrap.dedent(body), "train.py")
    offset = head.count("\n")
    assert [(f.line - offset, f.code) for f in found] == [(5, "LK004")]
    assert "`mask` built on the CPU (line" in found[0].message


LOADER = """\
from torch.utils.data import DataLoader

loader = DataLoader(dataset, batch_size=32, num_workers=4)
for batch in loader:
    ids = {ids}
    ids = ids.long()
    loss = model(ids.to(device)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_loader_whose_batches_are_rebuilt_on_the_host_needs_no_pinning() -> None:
    """Token ids padded into a new tensor before the move: the loader's own tensors never
    travel (no LK007); the same loader whose batch is moved as it comes is LK007."""
    rebuilt = LOADER.format(ids='torch.tensor(pad(batch["ids"]))')
    assert _codes(rebuilt) == []
    assert _codes(LOADER.format(ids='batch["ids"]')) == [(3, "LK007")]


EVAL_EPOCHS = """\
for epoch in range(10):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        for xv, yv in val_loader:
            out = model(xv.to(device))
            {line}
    model.train()
"""


@pytest.mark.parametrize(
    "line",
    ["assert (out >= 0).all()", "preds = out.argmax(1).cpu()"],
)
def test_an_assert_or_an_unused_copy_per_evaluation_batch_is_found(line: str) -> None:
    """An ``assert`` on a device tensor takes its truth on the host, and predictions copied
    to the host that nothing reads wait for nothing useful: LK014 per evaluation batch."""
    assert _codes(EVAL_EPOCHS.format(line=line)) == [(11, "LK014")]


def test_predictions_copied_for_later_use_are_not_flagged_as_unused() -> None:
    """``preds`` read afterwards (kept for a confusion matrix) is the data's way out: quiet."""
    body = EVAL_EPOCHS.format(line="preds = out.argmax(1).cpu()\n            kept.append(preds)")
    assert _codes(body) == []


CACHE = """\
import numpy as np
import torch

bases = {{}}


def spectrogram(y, n_fft, fmax):
    if fmax not in bases:
        basis = np.ones((80, n_fft // 2 + 1))
        bases[{key}] = torch.from_numpy(basis).float().to(y.device)
    return torch.matmul(bases[{key}], torch.stft(y, n_fft, return_complex=True).abs())


for step, (y, mel) in enumerate(loader):
    loss = (spectrogram(generator(y.cuda()), 1024, 8000) - mel.cuda()).abs().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_cache_that_never_hits_copies_at_every_call() -> None:
    """Tested for ``fmax``, filled under ``str(fmax) + "_" + str(device)``: never a hit, so the
    host-made basis is copied to the device every step (LK004); filled under ``fmax``, once."""
    broken = lint.check_source(CACHE.format(key='str(fmax) + "_" + str(y.device)'), "mel.py")
    assert [(f.line, f.code) for f in broken] == [(10, "LK004")]
    assert "never hits" in broken[0].message and "reached from mel.py:15" in broken[0].message
    assert lint.check_source(CACHE.format(key="fmax"), "mel.py") == []


def test_a_device_tensor_indexed_with_a_numpy_array_each_step_is_found() -> None:
    """``table[idx]`` with ``idx = np.random.choice(...)`` made in the step: the index array
    crosses to the device every step (LK004); a device-made index does not."""
    body = """\
    table = torch.randn(1000, 64).to(device)
    for step in range(1000):
        idx = {index}
        loss = model(table[idx]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
    head = HEAD.replace("import math\n", "import math\n\nimport numpy as np\n")
    host = body.format(index="np.random.choice(1000, 32)")
    assert _codes(host, head=head) == [(4, "LK004")]
    made_there = body.format(index="torch.randint(0, 1000, (32,), device=device)")
    assert _codes(made_there, head=head) == []


ID_DATA = """\
from torch.utils.data import DataLoader, Dataset


class Pieces(Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {item}


loader = DataLoader(Pieces(corpus), batch_size=8)
for batch in loader:
    loss = model(batch["input_ids"].to(device)).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_loader_of_token_ids_needs_no_workers_nor_pinning() -> None:
    """Items that are integer tensors of stored ids (a few KB a batch): no LK007; the same
    loader of float features decoded per item keeps it."""
    ids = '{"input_ids": torch.tensor(self.ids[i], dtype=torch.long)}'
    assert _codes(ID_DATA.format(item=ids)) == []
    decoded = '{"input_ids": torch.from_numpy(load_image(self.ids[i]))}'
    assert _codes(ID_DATA.format(item=decoded)) == [(15, "LK007")]


@pytest.mark.parametrize(
    "line",
    [
        'writer.add_scalar(tag="loss", scalar_value=loss, global_step=step)',
        "bar.set_postfix(loss=loss)",
        'print("loss %.4f" % loss)',
        'print("loss {:.4f}".format(loss))',
        'print("loss", loss)',
        'accelerator.log({"train_loss": loss}, step=step)',
        'writer.add_scalars("train", {"loss": loss}, step)',
        "wandb.log(dict(loss=loss))",
    ],
)
def test_more_spellings_of_a_hidden_loss_read_are_found(line: str) -> None:
    """Keyword-only tracker calls, a progress bar's postfix, %-formatting, str.format, a
    print of the tensor, Accelerate's tracker, add_scalars and dict(...): LK016 each."""
    assert _codes(STEP.format(line=line)) == [(7, "LK016")]


@pytest.mark.parametrize(
    "line",
    [
        'print(f"loss shape {loss.shape} dtype {loss.dtype} on {loss.device}")',
        "if loss is None: continue",
        "assert not isinstance(loss, float)",
        "pruner.log(loss)",
        "self_running_stats.log(loss)",
    ],
)
def test_metadata_identity_and_non_trackers_are_not_reads(line: str) -> None:
    """A tensor's shape, dtype or device, ``is None``, ``isinstance`` and a ``log`` method of
    an object that is no tracker wait for nothing: no LK016."""
    assert (7, "LK016") not in _codes(STEP.format(line=line))


def test_numpy_force_true_is_a_device_read() -> None:
    """``.numpy(force=True)`` copies a device tensor to the host: LK002 (plain ``.numpy()``
    would raise on it, so it is a host tensor's)."""
    line = "kept.append(loss.detach().numpy(force=True))"
    assert _codes(STEP.format(line=line)) == [(7, "LK002")]


def test_a_scalar_numpy_index_copies_nothing() -> None:
    """``data[np.random.randint(n)]``: a scalar index, no array crosses (no LK004)."""
    body = """\
    table = torch.randn(1000, 64).to(device)
    for step in range(1000):
        i = np.random.randint(1000)
        loss = model(table[i]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
    head = HEAD.replace("import math\n", "import math\n\nimport numpy as np\n")
    assert _codes(body, head=head) == []


@pytest.mark.parametrize("key", ["key", "int(n)"])
def test_a_cache_keyed_by_another_spelling_of_the_same_key_is_a_cache(key: str) -> None:
    """``key = (n, d)`` or ``int(n)`` after testing ``(n, d)``/``n``: taken on trust as the
    same key, a cache filled once (no LK004)."""
    source = f"""\
import torch


class Positions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = {{}}

    def forward(self, x, n, d):
        if {"(n, d)" if key == "key" else "n"} not in self.cache:
            key = (n, d)
            self.cache[{key}] = torch.arange(n).float().to(x.device)
        return x
"""
    assert lint.check_source(source, "pos.py") == []


def test_a_cpu_default_or_another_scripts_default_is_no_cuda_default(tmp_path: Path) -> None:
    """``set_default_device("cpu")`` is no CUDA default; a CUDA default set in an unrelated
    script of the same folder does not reach a file it does not import."""
    loop = (
        "for step in range(1000):\n"
        "    x = torch.Tensor([1.0, 2.0])\n"
        "    loss = model(x).sum()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )
    cpu = 'import torch\n\ntorch.set_default_device("cpu")\n' + loop
    assert lint.check_source(cpu, "run.py") == []
    (tmp_path / "train.py").write_text("import torch\n\nmodel = model.cuda()\n" + loop)
    (tmp_path / "bench.py").write_text('import torch\n\ntorch.set_default_device("cuda")\n')
    assert lint.check_paths([tmp_path]) == []
    (tmp_path / "bench.py").write_text(
        'import torch\n\ntorch.set_default_device("cuda")\nimport train\n'
    )
    assert [(Path(f.path).name, f.line, f.code) for f in lint.check_paths([tmp_path])] == [
        ("train.py", 5, "LK004")
    ]


def test_an_as_tensor_view_of_the_batch_still_wants_pinning() -> None:
    """``torch.as_tensor(batch[0])`` shares the batch's memory: the loader's tensor is what
    travels, so LK007 keeps asking for pin_memory."""
    body = LOADER.format(ids='torch.as_tensor(batch["ids"])')
    assert _codes(body) == [(3, "LK007")]
