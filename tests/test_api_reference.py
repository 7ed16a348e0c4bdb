"""The API reference (docs/api.md): every public name, each signature whole, no internals.

The first checks need no mkdocs: the page's entries against the packages' ``__all__``, the
mkdocstrings options that head each class with its constructor's signature, and each
parameter explained by its docstring. The last builds the site and reads the page.
"""

from __future__ import annotations

import html
import inspect
import re
from collections.abc import Iterator

import pytest
from helpers import ROOT

import loopkit
import loopkit.distributed
import loopkit.lint

API = (ROOT / "docs" / "api.md").read_text()
ENTRIES = re.findall(r"^::: ([\w.]+)$", API, flags=re.M)
# loopkit.lint.RULES is a dict without a docstring of its own: the page's prose explains it.
IN_PROSE = {"loopkit.lint.RULES"}
# Classes loopkit builds and hands out (preload, evaluate, loader, info, the linter): users
# never call their constructors, whose parameters are loopkit's own bookkeeping.
BUILT_BY_LOOPKIT = {
    "loopkit.Preloaded",
    "loopkit.Evaluation",
    "loopkit.distributed.EpochLoader",
    "loopkit.distributed.DistInfo",
    "loopkit.lint.Finding",
}
# Parameters the signature shows but the docstring does not explain yet (the report of
# issue 37 gives each its sentence). The set may only shrink: a new gap fails the test.
KNOWN_GAPS = {
    "loopkit.Checkpointer": {"amp"},
    "loopkit.accumulate": {"scheduler", "clip_grad_norm", "amp"},
    "loopkit.load_checkpoint": {"path"},
    "loopkit.lint.check_source": {"path"},
    "loopkit.lint.fix_source": {"path"},
    "loopkit.lint.main": {"argv"},
}  # fmt: skip


def _public() -> dict[str, object]:
    """Every public name of loopkit, loopkit.distributed and loopkit.lint, by its path."""
    found: dict[str, object] = {}
    for module in (loopkit, loopkit.distributed, loopkit.lint):
        for name in module.__all__:
            if name != "__version__":
                found[f"{module.__name__}.{name}"] = getattr(module, name)
    return found


def _parameters(obj: object) -> list[str]:
    """The parameters a user passes (no ``self``, ``*args`` or ``**kwargs``); [] if none."""
    if not callable(obj):
        return []
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature.parameters.values() if p.kind not in variadic]


def _docstring(obj: object) -> str:
    """The text that documents ``obj``'s parameters: a class's docstring and its __init__'s."""
    text = inspect.getdoc(obj) or ""
    init = vars(obj).get("__init__") if inspect.isclass(obj) else None
    return text + "\n" + ((inspect.getdoc(init) or "") if init is not None else "")


def _explains(doc: str, name: str) -> bool:
    """Whether ``doc`` names parameter ``name`` as a word of its own: in a literal such as
    ``name=N``, in prose, or in a sphinx field ``:param name:``."""
    return bool(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", doc))


def _gaps(public: dict[str, object]) -> dict[str, set[str]]:
    """Each entry point's parameters that its docstring does not explain."""
    gaps: dict[str, set[str]] = {}
    for path, obj in public.items():
        if path in BUILT_BY_LOOPKIT:
            continue
        doc = _docstring(obj)
        missing = {p for p in _parameters(obj) if not _explains(doc, p)}
        if missing:
            gaps[path] = missing
    return gaps


def test_every_public_name_has_one_entry_and_every_entry_is_public() -> None:
    """docs/api.md has one ``::: path`` per public name of the three packages, and no other."""
    public = set(_public())
    assert sorted(set(ENTRIES)) == sorted(ENTRIES), "an entry is listed twice"
    assert public - set(ENTRIES) - IN_PROSE == set(), "public names missing from docs/api.md"
    assert set(ENTRIES) - public == set(), "entries that are not public names"
    for path in IN_PROSE:
        assert f"`{path}`" in API


def test_the_reference_heads_each_class_with_its_whole_signature() -> None:
    """mkdocs.yml renders a class's constructor as its signature (annotated, in its own
    block, formatted by ruff from the docs extra) and leaks no internals: no private bases,
    no attribute values assigned in ``__init__``."""
    tomllib = pytest.importorskip("tomllib")
    config = (ROOT / "mkdocs.yml").read_text()
    options = dict(re.findall(r"^ {12}(\w+): (.+)$", config, flags=re.M))
    assert options["docstring_style"] == "sphinx"
    for name in (
        "merge_init_into_class", "show_signature", "show_signature_annotations",
        "separate_signature",
    ):  # fmt: skip
        assert options.get(name) == "true", name
    for name in ("show_bases", "show_attribute_values", "show_source"):
        assert options.get(name) == "false", name
    docs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "docs"
    ]
    names = {re.split(r"[\[<>=!~ ]", req)[0] for req in docs}
    # separate_signature formats with ruff or black when either is importable.
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "ruff"} <= names
    assert any(req.startswith("mkdocstrings[python]") for req in docs)


def test_every_parameter_of_every_entry_point_is_explained() -> None:
    """Each parameter of a public class's constructor or a public function is named by its
    docstring, but for the known gaps, which may only shrink (and each is a real one)."""
    public = _public()
    for path, missing in KNOWN_GAPS.items():
        assert missing <= set(_parameters(public[path])), f"{path}: no such parameters"
    gaps = _gaps(public)
    new = {p: m - KNOWN_GAPS.get(p, set()) for p, m in gaps.items()}
    assert {p: m for p, m in new.items() if m} == {}, "parameters no docstring explains"


def test_the_gap_check_finds_an_unexplained_parameter() -> None:
    """The check above is not vacuous: a parameter no docstring names is reported, one in
    a literal or a sphinx field is not."""

    def fit(model: object, epochs: int = 1, *, seed: int = 0, **rest: object) -> None:
        """Train ``model`` for ``epochs=N`` passes."""

    class Runner:
        """Runs things.

        :param speed: how fast
        """

        def __init__(self, speed: float, depth: int) -> None:
            """``depth``: how deep."""

    assert _gaps({"fit": fit, "Runner": Runner}) == {"fit": {"seed"}}
    assert _explains("``every=N``", "every") and not _explains("``every_n``", "every")
    assert not _explains("``acc.flush()``", "flush")  # a method of the object, not a parameter


def _sections(page: str) -> Iterator[tuple[str, str, str]]:
    """(object path, its signatures' text, its whole section's text) for each heading."""
    heads = list(re.finditer(r'<h[2-6] id="([\w.]+)" class="doc doc-heading">', page))
    for here, after in zip(heads, [*heads[1:], None], strict=True):
        body = page[here.end() : after.start() if after else len(page)]
        # Each overload has a signature block of its own, the implementation's last.
        sigs = re.findall(r'<div class="doc-signature highlight">(.*?)</pre>', body, flags=re.S)
        yield here.group(1), "\n".join(map(_text, sigs)), _text(body)


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


# Private names the page still shows, each waiting for a docstring change in a module under
# another engineer's edit (see issue 37's report): accumulate's docstring names its update
# rule; check_paths' default is a private function.
KNOWN_LEAKS = {"_update.UpdateRule.apply", "= _report_skip"}


def check_built_page(page: str) -> None:
    """The built API page (tests/test_docs.py builds the site once, and calls this): each
    public class and function is headed by a signature naming every parameter; no text names
    a private module or object (``_step.``, ``= _x``, a ``Layout:`` paragraph), and no
    private base class is shown."""
    page = page[page.index("<article") : page.index("</article>")]
    sections = {path: (sig, body) for path, sig, body in _sections(page)}
    public = _public()
    for path, obj in public.items():
        if path in IN_PROSE:
            continue
        assert path in sections, f"{path} has no heading"
        params = _parameters(obj)
        if params:
            sig = sections[path][0]
            assert sig, f"{path}: no signature"
            shown = set(re.findall(r"(\w+)\s*(?::|=|,|\))", sig))
            assert set(params) <= shown, f"{path}: {set(params) - shown} not in {sig}"
    text = _text(page)
    for leak in KNOWN_LEAKS:
        text = text.replace(leak, "")
    private = re.findall(r"(?<![\w.])_[a-z]\w*\.[A-Za-z_]\w*|= _\w+|Layout:", text)
    assert private == [], private
    # loopkit's own classes that are not public (mixins, state holders) never show as bases.
    hidden = {
        base.__name__
        for obj in public.values()
        if inspect.isclass(obj)
        for base in obj.__mro__[1:]
        if base.__module__.startswith("loopkit.") and base not in public.values()
    }
    assert hidden, "no private base to look for"
    bases = " ".join(re.findall(r"Bases:([^\n]*)", text))
    assert bases and not {b for b in hidden if re.search(rf"\b{b}\b", bases)}
