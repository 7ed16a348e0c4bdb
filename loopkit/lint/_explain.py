"""What a finding means, per rule: when its cost is real, when it is not (``--explain``).

The claim (``flags``, ``why``) and the fix come from the rule itself; this module adds the
two texts a rule cannot say in one line, and renders them for the terminal and for the
docs. docs/lint.md's section "When a cost is real" is :func:`markdown`, between two marker
comments; after editing a text here, regenerate it with
``python -c "from loopkit.lint._explain import write_docs; write_docs()"`` (a test fails
until the page matches).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from ._registry import REGISTRY

WIDTH = 88
START = "<!-- explain:start -->"
END = "<!-- explain:end -->"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "lint.md"


@dataclass(frozen=True)
class Explanation:
    """When a rule's cost is real, and when it is not: one markdown paragraph each."""

    real: str
    not_real: str


EXPLANATIONS: dict[str, Explanation] = {
    "LK001": Explanation(
        real="The list keeps each loss tensor and, through its `grad_fn`, that step's graph, "
        "until the list is dropped. Where nothing back-propagates that loss (an evaluation loop "
        "with autograd on) the graph still holds its saved activations, in device memory: "
        "memory grows by one forward's activations per step. After a plain `loss.backward()` "
        "(no `retain_graph=True`) the activations are freed and each step keeps the graph's "
        "nodes: a slower growth, in host memory.",
        not_real="A list of host values: no finding where the name is rebound in the loop to "
        "one (`loss = loss.item()`, `.detach()`, `float(loss)`), nor under `torch.no_grad()`; "
        "a name ending in `fn` or `func` (`loss_fn`) is not a loss. A list that gathers the "
        "losses for one backward over them (`torch.stack(losses).mean().backward()`) needs "
        "the graphs until then, and one cleared every few steps holds only those steps.",
    ),
    "LK002": Explanation(
        real="Only in a script that can run on an accelerator (it names cuda, mps, xpu or an "
        "accelerator, or moves tensors to a device or rank: on a CPU a read waits for "
        "nothing), only in a training step (a loop that back-propagates or steps the "
        "optimizer) or a function it calls (up to 6 calls deep), and not under `if step % N`.",
        not_real="`.numpy()` alone reads nothing from the device: it raises on a device "
        "tensor, so what it runs on is on the host already (a batch before its move, "
        "`y.numpy()` of `y = batch['y']`); in `t.cpu().numpy()` the `.cpu()` is the read "
        "(`t.numpy(force=True)` copies a device tensor: it is one). "
        "A read that steps a host environment (`actions = "
        "q(obs).argmax(1).cpu().numpy()` then `envs.step(actions)`: the transfer is the "
        "algorithm's input), a `.cpu()` of a tensor the same expression builds on the host "
        "(`torch.ones(1, 3).cpu()`), a loader batch read before the line that rebinds its "
        "name (`labels = one_hot(labels.numpy())`), and a read in an error path: the body of "
        "an `if` that ends in `raise` or `sys.exit(...)` (or `return` or `break` of the "
        "training loop) runs once, though the `if`'s own test runs every step (`if not "
        "math.isfinite(loss.item()):` is found, the `print(loss.item())` under it is not). "
        "A read under `if isinstance(v, torch.Tensor):` in a function whose every call site "
        "passes host values (`meter.update(loss=loss.item(), lr=...)`: a `.item()`, "
        "`float(...)`, a number, a name bound only to one) never runs; one call site with a "
        "tensor or `**kwargs` keeps it. `.cpu()` in a script that uses "
        "`torch.distributed.rpc` is the transport. None of these is reported.",
    ),
    "LK003": Explanation(
        real="In a loop that runs every step, each call syncs the device and empties the "
        "cache, so the next step's allocations go back to `cudaMalloc`. The rule flags it in "
        "any loop: in one that runs once an epoch the same cost is paid once an epoch.",
        not_real="Where an out-of-memory error is caught and retried with less (the call in a "
        "`try` block or its handler) it is the fix: no finding. Under `if step % N == 0:` it "
        "runs once per N steps, a rare release: no finding. Where another process on the "
        "same GPU needs the memory the cache holds, handing it back is the point.",
    ),
    "LK004": Explanation(
        real="A tensor built fresh on the host and moved (`torch.ones(...).to(device)`, "
        "`Tensor(b, 1).fill_(1.0).cuda()` through `Variable`), or a CUDA tensor type called on "
        "host data (`Tensor(np.random.normal(...))` with `Tensor = torch.cuda.FloatTensor if "
        "cuda else torch.FloatTensor`), every step: in a training loop, a function a training "
        "step calls, a module's `forward()`, or a function `forward()` calls (not under "
        "`% N`), found at its line (`rand_slice_segments`' "
        "`torch.rand([b]).to(device=x.device)`). A tensor built over several statements and "
        "moved later in the same function is found at the move (`labels = "
        "torch.cat([torch.arange(b)] * 2)`, ..., `labels = labels.to(device)`), also through "
        "`torch.from_numpy(np.ones(...))` and reshapes. Where the program makes new tensors "
        'on the device by default (`torch.set_default_device("cuda")`, '
        '`torch.set_default_tensor_type("torch.cuda.FloatTensor")`, in any of its files), '
        "`torch.Tensor([1e10])` or `torch.tensor(np.ones(...))` copies host data to the device "
        "at each call. A cache that never hits copies at every call too: under `if key not "
        "in cache:` a body that stores only under string keys (`cache[str(fmax) + '_' + "
        "str(device)] = t.to(device)`) after testing a key that is no string (`fmax`). So "
        "does a device tensor indexed with a numpy array made in the step (`table[idx]` with "
        "`idx = np.random.choice(n, k)`, `np.arange`, `np.where`): the index crosses each "
        "step. `import torch as th` is understood.",
        not_real="A move under `if key not in cache:` whose body stores under the key tested, "
        "or under another spelling of it (`key = (n, d)`, `int(n)`: taken on trust), fills "
        "the cache once per key: no finding. A scalar numpy index (`np.random.randint(n)`) "
        "copies nothing. The default device counts only for files the setting file is or "
        "imports, and only when it names CUDA. The same alias called on sizes (`Tensor(b, "
        "1).fill_(1.0)`) allocates on the "
        "device on a GPU run and builds nothing on the host (its cost, an allocation and a "
        "fill kernel, is the same as `torch.ones(..., device=device)`'s). A zero-element "
        "placeholder (`torch.empty(0).to(device)`, `torch.zeros((0, 3))`, `torch.tensor([])`) "
        "copies no bytes. Data from a variable (`torch.Tensor(obs).to(device)` of an "
        "environment's observation, a batch) has to cross anyway: only data the script makes "
        "itself on the host (a numpy call, a list literal, a name bound to one) is reported. In "
        "`forward()`, a branch taken only when a parameter that defaults to False/None is set "
        "(`if not reverse: ... else:`) is not per step when every call that sets it is off the "
        "step (`infer()`: in no `forward`, reached by no training step); a call from `forward` "
        "that sets it keeps the finding. None of these is reported.",
    ),
    "LK005": Explanation(
        real="Two forms: one expression that goes to the host and back (`x.cpu().cuda()`, "
        "`torch.from_numpy(x.cpu().numpy()).cuda()`), anywhere in the file, and the same name "
        "moved with both `.cpu()` and `.cuda()` in one loop body. In a loop that runs every "
        "step, each round trip is two copies and a sync per step.",
        not_real="A move under `if step % N == 0:` (a periodic snapshot) is rare enough: no "
        "finding. A round trip outside every loop is paid once. Where the host computes "
        "something between the moves that the device cannot (a numpy or scipy call), the "
        "copies are that computation's price: move it to the device if torch has it.",
    ),
    "LK006": Explanation(
        real="Whenever it drives two or more GPUs: every step it copies the parameters to each "
        "GPU, scatters the batch from the first, gathers the outputs back to it, and runs the "
        "replicas in threads of one Python process. The rule flags every `DataParallel(...)`.",
        not_real="With one visible GPU (or one `device_ids` entry) it calls the module "
        "directly: no replicas, nothing lost and nothing gained. DDP needs one process per "
        "GPU, launched with `torchrun`.",
    ),
    "LK007": Explanation(
        real="A loader read every step of training. Without `num_workers` the main process "
        "loads each batch while the device waits; without `pin_memory` in a script that names "
        "CUDA each batch is copied from pageable memory. With `check_paths` (or a folder on the "
        "command line) a loader built in a helper file that never names CUDA is asked for "
        "`pin_memory` when a CUDA script checked with it calls into that file. A script that "
        "does not train is there to run its one pass: it counts.",
        not_real="A loader over a Dataset of the program whose `__getitem__` returns only integer "
        "tensors of what it holds (`torch.tensor(self.ids[i], dtype=torch.long)`, a dict or "
        "tuple of them): token ids, a few KB a batch, gain nothing measurable from workers or "
        "pinning. Batches rebuilt on the host before their move, in every loop over the loader "
        "(`ids = torch.tensor(pad(batch))`, then `ids.to(device)`): the loader's own tensors "
        "never travel, so `pin_memory` buys nothing and is not asked for. "
        "A loader only previewed (`next(iter(loader))` off the step: one batch), or "
        "read in a single pass outside every loop, before or after training (a small test set "
        "at the end of a tutorial: the wait is paid once). `pin_memory` is not asked of a "
        "loader whose `collate_fn` (of the same file, or of a file checked with it: "
        "`utils.collate_fn`) returns an instance of a plain class (no `pin_memory()` method, "
        "not a tuple, dict or sequence), alone or as an element of a tuple (`batch[0] = "
        "NestedTensor(...)`; `return tuple(batch)`): `pin_memory=True` pins nothing of it, at "
        "most the small rest. Data sets of in-memory tensors (`TensorDataset`, also returned "
        "by a helper) need no workers; tokenized text padded by `tokenizer.pad` or a "
        "`DataCollator` (a few KB of token ids, collated in a millisecond while the device "
        "runs) needs neither workers nor pinning; a Dataset whose `__getitem__` moves samples "
        "to the device cannot use workers and `pin_memory=True` would raise (the cost is that "
        "move). `num_workers=0` written out, or `pin_memory` set without workers, is taken as "
        "a considered choice: no finding for the workers.",
    ),
    "LK008": Explanation(
        real="A forward after `model.eval()` in the same function, or a forward in a loop of "
        "an evaluation function (evaluate, validate, test...) that is called inside a loop "
        "(per epoch) and never under `no_grad`: each batch records a graph that nothing "
        "back-propagates.",
        not_real="A caller that wraps the call in `no_grad` covers it, a function nothing "
        "calls is left to its caller, and a function that turns autograd off anywhere in its "
        "body is trusted. A preview under `if step % N == 0:` in the loop (sampling images, "
        "generating text), or in a function called only there, records one graph per N "
        "steps: no finding. In a script that trains, a forward after `model.eval()` that runs "
        "once (a model summary at start-up, one test pass after training, its loop run once) "
        "records its graphs once: no finding. PyTorch 0.3's `Variable(..., volatile=True)` "
        "turns autograd off too, which the rule does not know: a finding there is wrong.",
    ),
    "LK009": Explanation(
        real="When the batches of a pass are not a multiple of N: the last `len(loader) % N` "
        "micro-batches are back-propagated but never stepped, and the `if` that steps has no "
        "clause for the last batch.",
        not_real="Not when the loop skips the batches past the last whole window before the "
        "forward (`if step >= steps_per_epoch: continue`), when the optimizer also steps after "
        "the loop (the tail is flushed), nor when the test that steps names the end "
        "(`len(loader)`, a name or attribute with `last` in it: `or is_last_batch`). When "
        "every pass's batch count is a multiple of N, nothing is lost.",
    ),
    "LK010": Explanation(
        real="`set_to_none=False`: every step a fill kernel per gradient tensor, and the next "
        "backward adds into the zeros instead of writing the gradient; the cost grows with the "
        "number of parameter tensors. No `zero_grad` at all (found at the optimizer step of a "
        "training loop): each update uses the sum of every step's gradients so far, a wrong "
        "result and not only a slow one.",
        not_real="A script that adds into `.grad` itself (`p.grad += g`) needs the zeros in "
        "place: no finding for `set_to_none=False`. Gradients reset another way (`p.grad = "
        "None`, `p.grad.zero_()`, any `.zero_grad` in the file, `loopkit.step` or "
        "`loopkit.accumulate`) or kept per context by `dist_autograd` (`torch.distributed.rpc`"
        "): no finding for a missing `zero_grad`. Where a parameter gets no gradient on some "
        "step, `set_to_none=True` changes results (see `--fix`): `False` may be deliberate.",
    ),
    "LK011": Explanation(
        real="Only in a script that resumes (a `resume` argument or name, "
        "`accelerator.load_state`, an optimizer's `load_state_dict`, a model's from "
        "`torch.load`), only for shuffled loaders with workers (`shuffle=True`, or a "
        "`RandomSampler` with no generator) and neither `generator` nor `worker_init_fn`, "
        "and only for a loader a training loop reads. It costs reproducibility, not speed.",
        not_real="A `DistributedSampler` orders by seed and epoch, so a resume replays it; a "
        "helper loader that no training loop reads (statistics, previews) is not what a resume "
        "replays. None is reported. A loader whose order changes no result (a development "
        "set) is flagged, needlessly.",
    ),
    "LK012": Explanation(
        real="When the GradScaler is enabled (float16): the clip sees gradients multiplied by "
        "the current scale. Found when a `.scale(...)` of an object named like a scaler comes "
        "before `clip_grad_norm_` (or `clip_grad_value_`) on its path and the function has no "
        "`unscale_`.",
        not_real="A scaler built with `enabled=False` (a bfloat16 or float32 run) returns the "
        "loss unscaled, so the clip is right. A clip in a branch without the scaler is not "
        "flagged. An `unscale_` in another function that runs before the clip is not seen: "
        "that finding is wrong.",
    ),
    "LK013": Explanation(
        real="When the object is a DataLoader, or another iterable that loads or computes each "
        "item: the whole pass is paid to count it. Found for `len(list(x))` and "
        "`len(tuple(x))` of a name or attribute.",
        not_real="The rule does not know the object's type: of a list or another in-memory "
        "collection, `list(x)` is a cheap copy. An iterable with no length (a generator, the "
        "loader of an `IterableDataset`, where `len(loader)` raises) can only be counted this "
        "way.",
    ),
    "LK014": Explanation(
        real="Only where the evaluation runs periodically (per epoch, every N steps, or in a "
        "script that only evaluates), in a program that runs on an accelerator. An evaluation "
        "loop is one with no backward that runs with autograd off (around it or in its "
        "body), or whose function is named for evaluation, or calls `model.eval()` before "
        "it (`metrics`, `accuracy`); it counts wherever it is, inside the training loop under "
        "`if step % N == 0:` too. A read there is a metric read back (a loss, an accuracy, a "
        "count of correct...; `metric.add_batch(...)` of Hugging Face evaluate converts its "
        "tensors to host lists), an `assert` on a device tensor (`assert (out >= 0).all()`), "
        "or a copy to the host that nothing in the function reads again (`preds = "
        "out.argmax(1).cpu()`, unused).",
        not_real="In a training script, an evaluation loop that runs once (outside every "
        "loop, its function called only outside loops) is a one-off and gets no finding. A "
        "read that feeds a per-sample Python loop (printing each mistake) is needed on the "
        "host, sample by sample: no finding. Nor is a read under `if step % N` inside the "
        "evaluation loop, nor predictions copied to the host and used afterwards (kept for a "
        "confusion matrix): that is the data's way out.",
    ),
    "LK015": Explanation(
        real="In a training loop: `total += loss`, where `loss` is the tensor the loop "
        "back-propagates. The sum is a tensor with a `grad_fn` that chains to every step's "
        "graph, kept alive until the sum is dropped. With `retain_graph=True`, or a sum taken "
        "before a backward that never comes, that includes the activations; after a plain "
        "`loss.backward()` they are freed and the chain keeps the graphs' nodes, in host "
        "memory.",
        not_real="`total += loss.detach()` or `loss.item()` (a rebinding in the loop to one "
        "is seen), and a sum under `torch.no_grad()`, are not flagged. A sum reset every few "
        "steps keeps only those steps' graphs.",
    ),
    "LK016": Explanation(
        real="Only in a program that runs on an accelerator, only in the body of a training "
        "loop (a function it calls is not looked into), and not under `if step % N`. The loss "
        "is the tensor back-propagated by name: `loss` in `loss.backward()`, "
        "`accelerator.backward(loss)` or `scaler.scale(loss).backward()`. Each of these needs "
        "its value on the host: a branch or `assert` on it, `float(loss)`, "
        "`float(torch.exp(loss))` (the exponential is on the device, the float is a read), "
        "`math.exp(loss)`, the loss formatted into a string (an f-string, `%`, `str.format`, "
        '`print("loss", loss)`, a progress bar\'s `set_description` or `set_postfix(loss='
        'loss)`), and a tracker given it (`wandb.log({"loss": loss})`, `accelerator.log'
        '(...)`, `writer.add_scalar("loss", loss, step)` or with keywords, `add_scalars`, '
        '`mlflow.log_metric("loss", loss)`), which reads it to record a number.',
        not_real="`accelerator.backward(loss)` makes `loss` the loss, not `accelerator`: `if "
        "accelerator.sync_gradients:` is a Python bool. A name rebound to a host value in the "
        "loop (`loss = loss.item()`) is one too. What a tensor tells without its values waits "
        "for nothing: `loss.shape`, `.dtype`, `.device`, `.requires_grad`, `loss is None`, "
        "`isinstance(loss, T)`. A use that reads explicitly (`if loss.item() < best:`, "
        "`f\"{loss.item():.3f}\"`) is LK002's finding, not this one's. A `log` method counts "
        "as a tracker's only on a name made of a tracker's word (wandb, run, experiment, "
        "tracker, accelerator, mlflow, neptune, comet): `logger.log(...)`, `pruner.log(x)` are "
        "not. Under `if step % N == 0:` it is once per N steps.",
    ),
    "LK017": Explanation(
        real="Every step in the training loop or in a function it calls.",
        not_real="Not once after the loop (a timing point), not under `if step % N`, and not "
        "under a timing, profiling or debug flag (`if args.sync_step:`, a name with `sync`, "
        "`debug`, `profil` or `bench` in it): there it was asked for.",
    ),
    "LK018": Explanation(
        real="A loop that back-propagates every micro-step and steps the optimizer only under "
        "a `%` test, with `zero_grad()` outside such a test: the gradients of the window's "
        "earlier micro-batches are erased before the update.",
        not_real="A `zero_grad()` under a `%` test (with the step) is not flagged. With N = 1 "
        "every micro-step is an update and nothing is lost; the rule does not evaluate N.",
    ),
    "LK019": Explanation(
        real="A `for` loop over anything but `step.iterate(...)` around `with step:`, where "
        "`step` is a `loopkit.step(..., accumulate=N)` or `loopkit.accumulate(..., every=N)` "
        "with N not the literal 1: the window that spans the end of a pass is not closed.",
        not_real="With N = 1 there is no window. When every pass's batch count is a multiple "
        "of N, the windows end with the passes and nothing is lost.",
    ),
    "LK020": Explanation(
        real="A `torch.compile(model)` (or `model.compile()`) of a name that holds a model "
        "wrapped by `DDP(...)`, `DistributedDataParallel(...)`, `fully_shard(model)` or "
        "`loopkit.distributed.wrap(...)` earlier in the same function or module, at every "
        "forward.",
        not_real="FSDP1 is not flagged: PyTorch's FSDP1 recipe compiles the wrapped model "
        "(`use_orig_params=True`). Compiled first, then wrapped, there is nothing to find; "
        "`torch.compile(model.module)` compiles inside the wrapper, not around it.",
    ),
    "LK021": Explanation(
        real="Only in a script that can run on an accelerator, in a training step or a "
        "function it calls, and not under `if step % N`. It takes the truth of a tensor only "
        "where the expression is one (`torch.isnan(x)`, `t.any()`, `(x > 0).all()`, "
        "`torch.norm(g) > 10`, `any(not torch.isfinite(p.grad).all() for p in params)`), or "
        "a name its function binds to a tensor computed from a gradient (`coef = clip / "
        "(p.grad.data.norm(2) + 1e-6)`; `if coef < 1:`).",
        not_real="numpy's, math's and the builtin `any()` over Python values are host values, "
        "and so is a batch straight from the loader: no finding. A test on the loss is "
        "LK016's, one with an explicit `.item()` LK002's.",
    ),
}


def _sentence(text: str) -> str:
    return text if text.endswith(".") else text + "."


def explain(code: str) -> str:
    """Rule ``code``'s text for the terminal: its claim, when the cost is real and when
    not, and its fix (printed whole, on one line, to be copied)."""
    rule, more = REGISTRY[code], EXPLANATIONS[code]
    status = (
        "on by default"
        if rule.default
        else f"off by default; run it with --select {code} (or --all)"
    )
    lines = [f"{code} ({rule.theme}): {status}"]
    sections = [
        ("Flags", rule.flags),
        ("Why it costs", rule.why),
        ("When the cost is real", more.real),
        ("When it is not", more.not_real),
    ]
    for title, text in sections:
        lines += ["", title]
        lines += textwrap.wrap(
            _sentence(text),
            WIDTH,
            initial_indent="    ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    lines += ["", "Fix", "    " + rule.fix]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """docs/lint.md's section: one ``### LKxxx`` subsection per rule, with the same texts."""
    parts = []
    for code, rule in REGISTRY.items():
        more = EXPLANATIONS[code]
        claim = f"**Flags:** {_sentence(rule.flags)} **Why it costs:** {_sentence(rule.why)}"
        if not rule.default:
            claim += f" Off by default: run it with `--select {code}` (or `--all`)."
        parts += [
            f"### {code} ({rule.theme})",
            claim,
            f"**When the cost is real:** {more.real}",
            f"**When it is not:** {more.not_real}",
            f"**Fix:** {rule.fix}",
        ]
    return "\n\n".join(parts) + "\n"


def with_explanations(page: str) -> str:
    """``page`` (docs/lint.md's text) with what lies between the explain markers replaced
    by :func:`markdown`."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"no {START} ... {END} markers in the page")
    return f"{head}{START}\n\n{markdown()}\n{END}{tail}"


def write_docs(path: Path = DOCS) -> None:
    """Regenerate docs/lint.md's explanations section from :data:`EXPLANATIONS`."""
    path.write_text(with_explanations(path.read_text()))
