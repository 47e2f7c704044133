"""Every Python example in README.md and docs/*.md runs as written, and the README's install commands install
what those examples import. The README's Quick start also does what it says: it trains like eager PyTorch, its
step is planned under the budget, and the step with AdamW's state measures within it.

A doc's examples run in order in one namespace, as a reader would paste them, in a scratch folder. An example
may be marked, in an HTML comment on the line above its fence: `<!-- not run by the tests: why -->` (it needs
what this machine lacks: several ranks or devices) is compiled and the fxmem names it uses looked up;
`<!-- signatures: ... -->` is compared with the functions' own signatures; `<!-- the tests run this with A=B
... -->` runs with each `A` replaced by `B` (a size that keeps the suite fast), each found once.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import logging
import pathlib
import re
import shlex
import sys
import tomllib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN, SIGNATURES, SMALLER = "not run by the tests:", "signatures:", "the tests run this with "


@dataclasses.dataclass(frozen=True)
class Example:
    path: pathlib.Path
    line: int
    code: str
    mark: str  # the HTML comment on the line above the fence, or ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples(path: pathlib.Path) -> list[Example]:
    text = path.read_text()
    found = []
    for match in re.finditer(r"(?:<!-- ([^\n]*?) -->\n)?```python\n(.*?)```", text, re.S):
        found.append(Example(path, text[:match.start()].count("\n") + 1, match.group(2), match.group(1) or ""))
    return found


def _with_sizes(example: Example) -> str:
    if not example.mark.startswith(SMALLER):
        return example.code
    code = example.code
    for name, value in (size.split("=") for size in example.mark[len(SMALLER):].split(":")[0].split(", ")):
        written = re.findall(rf"\b{name}=(\w+)", code)
        assert len(written) == 1, f"{example.where}: {name}= is not in the example once"
        code = re.sub(rf"\b{name}={written[0]}\b", f"{name}={value}", code)
    return code


@contextlib.contextmanager
def _scratch(tmp_path, monkeypatch):
    """A scratch folder, seed 0, and torch's compile settings and Dynamo's caches as they were afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    functorch, inductor = torch._functorch.config.save_config(), torch._inductor.config.save_config()
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch._functorch.config.load_config(functorch)
        torch._inductor.config.load_config(inductor)
        torch._dynamo.reset()


def run_examples(path: pathlib.Path, scope: dict | None = None) -> list[dict]:
    """Run the doc's examples that are not marked `not run` or `signatures`, in order, in one namespace; the
    namespace after each, copied."""
    scope = {} if scope is None else scope
    after = []
    for example in examples(path):
        if example.mark.startswith((NOT_RUN, SIGNATURES)):
            continue
        exec(compile(_with_sizes(example), example.where, "exec"), scope)
        after.append(dict(scope))
    return after


# ---- the README -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    """The README's examples run once: the namespace after each, what they printed, what transformers warned."""
    pytest.importorskip("transformers")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, _scratch(tmp_path_factory.mktemp("readme"), monkeypatch), \
            contextlib.redirect_stdout(out):
        try:
            after = run_examples(README)
        finally:
            logger.removeHandler(handler)
    return after, out.getvalue(), records


def test_readme_examples_run_as_written_without_token_id_warnings(readme):
    after, printed, records = readme
    assert len(after) == len(examples(README)) >= 2
    assert "predicted peak" in printed  # the Quick start's table
    # GPT2Config's default token ids (50256) lie outside a 1024-token vocabulary unless the example sets them
    assert [r.getMessage() for r in records if "token_id" in r.getMessage()] == []
    loaded = after[-1]["step"]  # "Three ways in": the saved plan applied
    assert after[-1]["plan"].budget_bytes == int(0.015 * 2**30) and loaded.fxmem_model is after[0]["model"]


def run_quick_start(optimize) -> dict:
    """The Quick start from seed 0 with `fxmem.optimize` replaced by `optimize` (its table not printed)."""
    import fxmem

    torch.manual_seed(0)
    scope: dict = {}
    real = fxmem.optimize
    fxmem.optimize = optimize
    try:
        exec(compile(examples(README)[0].code.replace("print(step.plan.table())", ""), "README.md", "exec"), scope)
    finally:
        fxmem.optimize = real
    return scope


def test_quick_start_trains_like_eager_within_its_budget(readme):
    from fxmem.measure import _StepTracker, training_step

    planned = readme[0][0]
    eager = run_quick_start(optimize=lambda model, **_: model)
    for (name, p), (_, q) in zip(planned["model"].named_parameters(), eager["model"].named_parameters()):
        assert torch.equal(p, q), name  # three AdamW steps through the plan equal eager's
    step, plan, ids = planned["step"], planned["step"].plan, planned["ids"]
    assert plan.recompute and plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert plan.budget_bytes == int(0.015 * 2**30) and plan.optimizer_state_bytes > 0
    tracker = _StepTracker()  # the step, with the optimizer's state held, by an independent meter
    tracker.track_external(step, planned["optimizer"], ids)
    with tracker:
        training_step(step, (), {"input_ids": ids, "labels": ids})
    measured = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    assert measured <= plan.budget_bytes


def _installs(command: str, extras: dict[str, list[str]], core: list[str]) -> set[str]:
    """The distributions `pip install ... -e ".[a,b]"` installs (by name), fxmem's own included."""
    names = set()
    for word in shlex.split(command):
        match = re.fullmatch(r"\.(?:\[(.*)\])?", word)
        if match:
            chosen = match.group(1).split(",") if match.group(1) else []
            names |= {re.split(r"[<>=\[ ]", req)[0].lower() for req in core + sum((extras[e] for e in chosen), [])}
    return names


def test_the_readmes_first_command_installs_what_its_examples_use():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = README.read_text()
    first = re.search(r"```bash\n(pip install [^\n]*)", text).group(1)
    installed = _installs(first, project["optional-dependencies"], project["dependencies"]) | {"fxmem"}
    used = set()
    for path in DOCS:
        for example in (e for e in examples(path) if not e.mark.startswith(SIGNATURES)):
            for node in ast.walk(ast.parse(example.code)):
                if isinstance(node, ast.Import):
                    used |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    used.add(node.module.split(".")[0])
    used -= set(sys.stdlib_module_names)
    assert "transformers" in used and used <= installed, (used - installed, first)
    if "--plot" in text:
        assert "matplotlib" in installed, first


def test_the_readmes_commands_take_their_flags_and_name_models_that_ship():
    from fxmem import models
    from fxmem.cli.main import _parser

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            for command in line.split("#")[0].split("&&"):
                words = shlex.split(command)
                if words and words[0] == "fxmem-plan":
                    commands.append(words[1:])
    assert len(commands) >= 6
    for argv in commands:
        args = _parser().parse_args(argv)  # an unknown flag exits here
        if args.model is not None and args.model not in models.list_models():
            module, _, factory = args.model.partition(":")
            assert importlib.util.find_spec(module) is not None, f"{args.model}: no such module ships"
            assert hasattr(importlib.import_module(module), factory), args.model


# ---- docs/*.md ------------------------------------------------------------------------------------------
RUN = [path for path in DOCS[1:] if any(not e.mark.startswith((NOT_RUN, SIGNATURES)) for e in examples(path))]


@pytest.mark.parametrize("path", RUN, ids=[path.name for path in RUN])
def test_docs_examples_run_as_written(path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    with _scratch(tmp_path, monkeypatch):
        after = run_examples(path)
    assert after and all(isinstance(scope, dict) for scope in after)


def test_every_mark_is_one_the_tests_know_and_says_why():
    for path in DOCS:
        for example in examples(path):
            if example.mark:
                assert example.mark.startswith((NOT_RUN, SIGNATURES, SMALLER)), example.where
                assert len(example.mark.split(":", 1)[-1].strip()) > 10, f"{example.where}: say why"


def _fxmem_names(code: str) -> list[str]:
    """`fxmem.a.b` attribute paths and `from fxmem.x import y` names an example uses."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fxmem":
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            parts = []
            while isinstance(node, ast.Attribute):
                parts.insert(0, node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "fxmem":
                names.append(".".join(["fxmem", *parts]))
    return names


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ImportError(name)


def test_examples_not_run_here_still_compile_and_name_what_fxmem_has():
    marked = [e for path in DOCS for e in examples(path) if e.mark.startswith(NOT_RUN)]
    assert marked
    for example in marked:
        compile(example.code, example.where, "exec")
        for name in _fxmem_names(example.code):
            try:
                _resolve(name)
            except (ImportError, AttributeError):
                pytest.fail(f"{example.where}: {name} does not exist")


def _documented(listing: str, name: str) -> list[tuple[str, str | None]]:
    """(parameter, default as written or None) of `fxmem.<name>(...)` in the listing; "*" for the bare star."""
    text = listing[listing.index(f"fxmem.{name}(") + len(f"fxmem.{name}("):]
    depth, items, current = 0, [], ""
    for char in text:
        if char == ")" and depth == 0:
            break
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [(item.split("=")[0].strip(), item.split("=", 1)[1].strip() if "=" in item else None)
            for item in items if item.strip()]


def test_documented_signatures_are_the_functions_own():
    import fxmem
    from fxmem.api import OPTIMIZE_SPELLINGS, PLAN_SPELLINGS

    doc = ROOT / "docs" / "python-api.md"
    (listing,) = [e for e in examples(doc) if e.mark.startswith(SIGNATURES)]
    text = doc.read_text()
    for name, spellings in (("plan", PLAN_SPELLINGS), ("optimize", OPTIMIZE_SPELLINGS), ("estimate", {})):
        written = _documented(listing.code, name)
        params = [p for p in inspect.signature(getattr(fxmem, name)).parameters.values()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert [w for w, _ in written if w != "*"] == [p.name for p in params], name
        star = [w for w, _ in written].index("*")
        for (word, default), p in zip([w for w in written if w[0] != "*"], params):
            keyword_only = [w for w, _ in written].index(word) > star
            assert keyword_only == (p.kind is inspect.Parameter.KEYWORD_ONLY), (name, word)
            if default is not None:
                assert ast.literal_eval(default) == p.default, (name, word)
        for keyword in spellings:  # the keywords taken besides the signature's are documented too
            assert f"`{keyword}=" in text, (name, keyword)
