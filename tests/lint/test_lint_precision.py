"""loopkit.lint names a cost only where one exists (issue 36): each precision fix keeps a
legitimate loop silent, and its near twin, where the cost is real, still fires; the new
recall (host tensors, implicit bool()) finds exactly the lines it should."""

from __future__ import annotations

import pytest

from loopkit import lint

EVERY = list(lint.RULES)

TRAIN = """\
for epoch in range(10):
    for x, y in train_loader:
        loss = crit(model(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
"""
LOADERS = (
    "import torch\ntrain_loader = DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True)\n"
)


def _found(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint.check_source(source, select=EVERY)]


CASES = {
    # LK007: a preview loader read with next(iter()) every 500 steps is silent; the same
    # loader read every step is a finding.
    "lk007-preview": (
        LOADERS
        + "preview = DataLoader(val, batch_size=8)\n"
        + TRAIN
        + "        if epoch % 5 == 0:\n            show(next(iter(preview)))\n",
        [],
    ),
    "lk007-read-every-step": (
        LOADERS
        + "preview = DataLoader(val, batch_size=8)\n"
        + TRAIN
        + "        show(next(iter(preview)))\n",
        [(3, "LK007")],
    ),
    # LK007: a single pass over a test set after training, once; inside the epoch loop it is
    # read every epoch: a finding.
    "lk007-one-off-test": (
        LOADERS
        + "test_loader = DataLoader(test, batch_size=100)\n"
        + TRAIN
        + "for x, y in test_loader:\n    print(model(x.cuda()).argmax(1))\n",
        [],
    ),
    "lk007-test-per-epoch": (
        LOADERS
        + "test_loader = DataLoader(test, batch_size=100)\n"
        + TRAIN
        + "    for x, y in test_loader:\n        print(model(x.cuda()).argmax(1))\n",
        [(3, "LK007")],
    ),
    # A script that only evaluates: its one pass is the workload.
    "lk007-eval-script": (
        "import torch\ntest_loader = DataLoader(test, batch_size=100)\n"
        "for x, y in test_loader:\n    print(model(x.cuda()).argmax(1))\n",
        [(2, "LK007")],
    ),
    # LK007 pin_memory: a collate_fn returning a plain class of the file pins nothing; a
    # NamedTuple is pinned, so asking for pin_memory is right.
    "lk007-custom-batch": (
        "import torch\nclass Batch:\n    def __init__(self, items):\n        self.items = items\n"
        "def collate(items):\n    return Batch(items)\n"
        "train_loader = DataLoader(ds, batch_size=64, num_workers=4, collate_fn=collate)\n" + TRAIN,
        [],
    ),
    "lk007-namedtuple-batch": (
        "import torch\nclass Batch(NamedTuple):\n    x: object\n    y: object\n"
        "def collate(items):\n    return Batch(items, items)\n"
        "train_loader = DataLoader(ds, batch_size=64, num_workers=4, collate_fn=collate)\n" + TRAIN,
        [(7, "LK007")],
    ),
    # A GPU script's training loader without pin_memory IS a finding.
    "lk007-gpu-no-pin": (
        "import torch\ntrain_loader = DataLoader(ds, batch_size=64, num_workers=4)\n" + TRAIN,
        [(2, "LK007")],
    ),
    # Tokenized text padded by tokenizer.pad, and a Dataset that moves samples to the device.
    "lk007-tokenizer-pad": (
        "import torch\ndef collate(rows):\n    return tokenizer.pad(rows, return_tensors='pt')\n"
        "train_loader = DataLoader(ds, batch_size=16, collate_fn=collate)\n" + TRAIN,
        [],
    ),
    "lk007-device-dataset": (
        "import torch\nclass Text(Dataset):\n    def __getitem__(self, i):\n"
        "        return self.data[i].to(device)\n"
        "train_loader = DataLoader(Text(), batch_size=16)\n" + TRAIN,
        [],
    ),
    # LK011: only in a script that resumes; not for a statistics loader; a seeded
    # DistributedSampler replays, an unseeded RandomSampler does not.
    "lk011-no-resume": (
        "import torch\n"
        "train_loader = DataLoader(ds, 64, shuffle=True, num_workers=4, pin_memory=True)\n" + TRAIN,
        [],
    ),
    "lk011-resume-arg": (
        "import torch\nparser.add_argument('--resume')\n"
        "train_loader = DataLoader(ds, 64, shuffle=True, num_workers=4, pin_memory=True)\n" + TRAIN,
        [(3, "LK011")],
    ),
    "lk011-resume-state-dict": (
        "import torch\n"
        "train_loader = DataLoader(ds, 64, shuffle=True, num_workers=4, pin_memory=True)\n"
        "ckpt = torch.load(path)\nmodel.load_state_dict(ckpt['model'])\n" + TRAIN,
        [(2, "LK011")],
    ),
    "lk011-stats-loader": (
        LOADERS + "parser.add_argument('--resume')\n"
        "stats = DataLoader(ds, 256, shuffle=True, num_workers=4, pin_memory=True)\n"
        "for x, _ in stats:\n    mean += x.mean(0)\n" + TRAIN,
        [],
    ),
    "lk011-distributed-sampler": (
        "import torch\nparser.add_argument('--resume')\n"
        "sampler = DistributedSampler(ds, seed=args.seed)\n"
        "train_loader = DataLoader(ds, 64, sampler=sampler, num_workers=4, pin_memory=True)\n"
        + TRAIN,
        [],
    ),
    "lk011-random-sampler": (
        "import torch\nparser.add_argument('--resume')\n"
        "sampler = RandomSampler(ds)\n"
        "train_loader = DataLoader(ds, 64, sampler=sampler, num_workers=4, pin_memory=True)\n"
        + TRAIN,
        [(4, "LK011")],
    ),
    # LK014: a one-off evaluation after training is silent; the same evaluation called in
    # the epoch loop reads per batch every epoch.
    "lk014-one-off": (
        "import torch\ndef test(model, loader):\n    correct = 0\n    with torch.no_grad():\n"
        "        for x, y in loader:\n"
        "            correct += (model(x.cuda()).argmax(1) == y.cuda()).sum().item()\n"
        "    return correct\n" + TRAIN + "print(test(model, test_loader))\n",
        [],
    ),
    "lk014-per-epoch": (
        "import torch\ndef test(model, loader):\n    correct = 0\n    with torch.no_grad():\n"
        "        for x, y in loader:\n"
        "            correct += (model(x.cuda()).argmax(1) == y.cuda()).sum().item()\n"
        "    return correct\n" + TRAIN + "    print(test(model, test_loader))\n",
        [(6, "LK014")],
    ),
    # LK014: an evaluation loop written in the epoch loop, autograd off inside its body;
    # metric.add_batch() (Hugging Face evaluate) converts device tensors to host lists.
    "lk014-inline-add-batch": (
        TRAIN + "    for x, y in val_loader:\n        with torch.no_grad():\n"
        "            out = model(x.cuda())\n"
        "        metric.add_batch(predictions=out.argmax(-1), references=y)\n"
        "        seen.append(out.shape)\n",
        [(10, "LK014")],
    ),
    # LK014: reads that feed a per-sample Python loop (printing each mistake) are needed.
    "lk014-per-sample-loop": (
        "import torch\ndef test(model, loader):\n    with torch.no_grad():\n"
        "        for x, y in loader:\n            pred = model(x.cuda()).argmax(1)\n"
        "            for p, t in zip(pred.cpu(), y):\n"
        "                if p.item() != t.item():\n                    print('wrong', p)\n"
        + TRAIN
        + "    test(model, test_loader)\n",
        [],
    ),
    # LK016: accelerator.backward(loss) makes `loss` the loss, not `accelerator`.
    "lk016-accelerate": (
        "import torch\nfor x, y in loader:\n    with accelerator.accumulate(model):\n"
        "        loss = crit(model(x), y)\n        accelerator.backward(loss)\n"
        "        if accelerator.sync_gradients:\n"
        "            accelerator.clip_grad_norm_(model.parameters(), 1.0)\n"
        "        opt.step()\n        opt.zero_grad()\n"
        "        if torch.isnan(loss):\n            break\n",
        [(10, "LK016")],
    ),
    # LK004: a CUDA tensor type called on sizes allocates on the device; on numpy data it
    # copies; a variable's data (an environment's observation) has to cross anyway.
    "lk004-legacy-types": (
        "import numpy as np\nimport torch\n"
        "Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor\n"
        "for x, _ in loader:\n    valid = Tensor(x.size(0), 1).fill_(1.0)\n"
        "    z = Tensor(np.random.normal(0, 1, (x.shape[0], 8)))\n"
        "    obs_t = torch.Tensor(obs).to(device)\n"
        "    noise = torch.FloatTensor(x.size(0), 8).normal_().cuda()\n"
        "    loss = f(valid, z, obs_t, noise)\n"
        "    loss.backward()\n    opt.step()\n    opt.zero_grad()\n",
        [(6, "LK004"), (8, "LK004")],
    ),
    # LK004: built over several statements, then moved; `th` for torch.
    "lk004-two-statements": (
        "import torch as th\n"
        "def info_nce(feats, device):\n"
        "    labels = th.cat([th.arange(8) for _ in range(2)], dim=0)\n"
        "    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()\n"
        "    labels = labels.to(device)\n"
        "    batch = feats.detach()\n    batch = batch.to(device)\n"
        "    return labels, batch\n"
        "for x in loader:\n    loss = f(*info_nce(model(x), dev))\n    loss.backward()\n"
        "    opt.step()\n    opt.zero_grad()\n",
        [(5, "LK004")],
    ),
    # LK002: a read that steps a host environment, a .cpu() of a host-built tensor and a
    # loader batch rebound after its read are not device syncs.
    "lk002-not-syncs": (
        "import torch\nfor step, (x, labels) in enumerate(loader):\n"
        "    actions = q(torch.Tensor(obs).to(device)).argmax(1).cpu().numpy()\n"
        "    obs, reward, done, info = envs.step(actions)\n"
        "    plot(torch.ones((1, 3)).cpu() * step)\n"
        "    labels = one_hot(labels.numpy())\n"
        "    loss = f(x.cuda(), labels)\n    loss.backward()\n    opt.step()\n    opt.zero_grad()\n"
        "    n = loss.item()\n",
        [(11, "LK002")],
    ),
    # LK021: implicit bool() of a device tensor every step; numpy's, math's and builtin
    # any() over Python values are host values; under `% N` it is rare enough.
    "lk021": (
        "import math\nimport numpy as np\nimport torch\n"
        "for step, (x, y) in enumerate(loader):\n    out = model(x.cuda())\n"
        "    if (out > 1e4).any() or not torch.isfinite(out).all():\n        continue\n"
        "    if np.isnan(history).any() or math.isinf(lr) or any(h > 9 for h in history):\n"
        "        break\n"
        "    loss = crit(out, y.cuda())\n    loss.backward()\n"
        "    if any(not torch.isfinite(p.grad).all() for p in model.parameters()):\n"
        "        opt.zero_grad()\n"
        "    if step % 100 == 0:\n        assert torch.isfinite(loss).all()\n"
        "    if y.any():\n        pass\n"
        "    opt.step()\n    opt.zero_grad()\n",
        [(6, "LK021"), (12, "LK021")],
    ),
    # LK017: a synchronize that times one call once, outside the loop, is silent.
    "lk017-benchmark-once": (
        "import torch\ndef timed(fn):\n    torch.cuda.synchronize()\n    fn()\n"
        "    torch.cuda.synchronize()\n" + TRAIN + "timed(lambda: model(x))\n",
        [],
    ),
    # LK008: a preview forward every 100 steps records one graph per 100 steps.
    "lk008-preview": (
        "import torch\ndef sample_images(model, x):\n    model.eval()\n    save(model(x))\n"
        "    model.train()\n"
        "for step, (x, y) in enumerate(loader):\n    loss = crit(model(x.cuda()), y.cuda())\n"
        "    loss.backward()\n    opt.step()\n    opt.zero_grad()\n"
        "    if step % 100 == 0:\n        sample_images(model, x.cuda())\n",
        [],
    ),
    # LK009: the batches past the last whole window are skipped before the forward.
    "lk009-tail-skipped": (
        "for i, (x, y) in enumerate(loader):\n    if i // 4 >= steps_per_epoch:\n        continue\n"
        "    loss = crit(model(x), y) / 4\n    loss.backward()\n"
        "    if (i + 1) % 4 == 0:\n        opt.step()\n        opt.zero_grad()\n",
        [],
    ),
}


@pytest.mark.parametrize(("source", "expected"), list(CASES.values()), ids=list(CASES))
def test_a_cost_only_where_one_exists(source: str, expected: list[tuple[int, str]]) -> None:
    """Exactly these (line, code) findings, every rule on."""
    assert _found(source) == expected
