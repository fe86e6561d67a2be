"""Layering: no layer below the faces knows HTTP (DESIGN.md, "One engine, several faces").

Every module of kvserve is parsed (not imported) and each import statement anywhere in it is
collected: top level, inside functions, under ``if TYPE_CHECKING``, and
``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "kvserve"

#: packages (and top-level modules) below the faces: they raise kvserve.errors' domain errors.
LOWER = ("kvserve.engine", "kvserve.chat", "kvserve.structured", "kvserve.models", "kvserve.loaders",
         "kvserve.store", "kvserve.errors", "kvserve.jsonvalues")
HTTP = ("kvserve.faces", "kvserve.serving")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str | None, level: int, here: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in module ``here``."""
    if level == 0:
        return module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module name ``path`` (a file under ``root``, the kvserve package directory) may
    import: for ``from a import b`` both ``a`` and ``a.b``."""
    here, is_package = _module_name(path, root), path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, here, is_package)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return names


@cache
def graph() -> dict[str, set[str]]:
    """module name -> the kvserve modules it imports."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        out[_module_name(path)] = {n for n in imports_of(path) if n == "kvserve" or n.startswith("kvserve.")}
    return out


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _offenders(sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    return sorted(f"{mod} imports {dep}" for mod, deps in graph().items() if _within(mod, sources)
                  for dep in deps if _within(dep, targets))


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    pkg = ROOT / "structured" / "spec.py"
    assert "kvserve.structured.schema" in imports_of(pkg)
    src = tmp_path / "kvserve" / "chat" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..faces import api_error\n    import kvserve.serving.state\n", encoding="utf-8")
    assert {"kvserve.faces", "kvserve.faces.api_error", "kvserve.serving.state"} <= imports_of(src, tmp_path / "kvserve")


def test_lower_layers_import_no_faces_and_no_serving():
    mods = graph()
    assert "kvserve.engine.request" in mods and "kvserve.chat.prompt" in mods  # the walk found the tree
    assert _offenders(LOWER, HTTP) == []


def test_serving_imports_no_faces():
    assert _offenders(("kvserve.serving",), ("kvserve.faces",)) == []


def _cycles(prefix: str) -> list[list[str]]:
    """Import cycles among the modules under ``prefix`` (the package ``__init__`` left out: it
    only re-exports)."""
    g = {m: {d for d in deps if d in graph() and d.startswith(prefix + ".")}
         for m, deps in graph().items() if m.startswith(prefix + ".")}
    found, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


@pytest.mark.parametrize("package", ["kvserve.structured", "kvserve.chat"])
def test_no_import_cycles(package):
    assert _cycles(package) == []


def test_structured_imports_go_one_way():
    g = graph()
    assert "kvserve.structured.backend" not in g["kvserve.structured.spec"]
    assert "kvserve.structured.backend" not in g["kvserve.structured.schema"]
    assert "kvserve.structured.spec" not in g["kvserve.structured.schema"]


# -- faces: one dialect each ----------------------------------------------------------------

#: each face's own modules: its routes and its wire types. Shared pieces live in neutral faces
#: modules (http, models, params, sse, server_extensions, chat_features...) or in kvserve.serving.
FACES = {
    "openai": ("kvserve.faces.openai", "kvserve.faces.openai_types"),
    "ollama": ("kvserve.faces.ollama_api", "kvserve.faces.ollama_types"),
    "anthropic": ("kvserve.faces.anthropic", "kvserve.faces.anthropic_types"),
    "responses": ("kvserve.faces.responses", "kvserve.faces.responses_types"),
    "llama": ("kvserve.faces.llama_api", "kvserve.faces.llama_types"),
    "router": ("kvserve.faces.router",),
    "embeddings": ("kvserve.faces.embeddings",),
}

#: (importer, imported face) pairs allowed, and why
ALLOWED_FACE_IMPORTS = {
    # vLLM's /v1/chat/completions/render and /v1/completions/render take OpenAI's requests
    # (vllm-router sends the client's OpenAI body): the OpenAI face reads them
    ("router", "openai"): "the render routes read OpenAI requests",
}


def _face_of(module: str) -> str | None:
    for face, mods in FACES.items():
        if _within(module, mods):
            return face
    return None


def test_every_face_module_exists():
    assert {m for mods in FACES.values() for m in mods} <= set(graph())


def test_no_face_imports_another_faces_modules():
    found = sorted({f"{mod} imports {dep}" for mod, deps in graph().items() if (face := _face_of(mod))
                    for dep in deps if (other := _face_of(dep)) not in (None, face)
                    and (face, other) not in ALLOWED_FACE_IMPORTS})
    assert found == []


#: strings only a dialect's JSON holds: object types, stream event types and usage keys
DIALECT_WORDS = frozenset({
    "chat.completion", "chat.completion.chunk", "text_completion",  # OpenAI
    "message_start", "message_delta", "message_stop", "content_block_start", "content_block_delta",
    "content_block_stop", "stop_reason",  # Anthropic
    "response.created", "response.completed", "response.output_text.delta",  # Responses
    "done_reason", "eval_count", "prompt_eval_count", "eval_duration",  # Ollama
    "finish_reason", "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
})


def dialect_strings(path: Path) -> list[str]:
    """The string constants of ``path`` (docstrings left out) that only a dialect's JSON holds."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return sorted(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and id(n) not in docs and n.value in DIALECT_WORDS)


def test_the_dialect_check_sees_a_serving_module_writing_openai(tmp_path):
    src = tmp_path / "x.py"
    src.write_text('"""Writes finish_reason."""\n\ndef f(out):\n    return {"object": "chat.completion", '
                   '"finish_reason": out.reason}\n', encoding="utf-8")
    assert dialect_strings(src) == ["chat.completion", "finish_reason"]


def test_the_serving_layer_builds_no_dialect_json():
    found = {str(p.relative_to(ROOT)): w for p in sorted((ROOT / "serving").rglob("*.py"))
             if (w := dialect_strings(p))}
    assert found == {}


#: OpenAI's answer fields (message and delta keys): only the OpenAI face writes them
OPENAI_ANSWER_FIELDS = frozenset({"tool_calls", "reasoning_content", "tool_call_id"})


def written_openai_fields(path: Path) -> list[str]:
    """The OpenAI answer field names ``path`` may write: string constants of
    :data:`OPENAI_ANSWER_FIELDS` anywhere but where a dict is read (``"k" in d``, ``d["k"]``,
    ``d.get("k")``: the serving layer reads the chat parsers' fragments and the messages it was
    given; docstrings and comments are not code)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    reads: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and all(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops):
            reads.add(id(n.left))
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load):
            reads.add(id(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args:
            reads.add(id(n.args[0]))
    return sorted(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                  and n.value in OPENAI_ANSWER_FIELDS and id(n) not in reads)


def test_the_openai_field_check_tells_reading_from_writing(tmp_path):
    src = tmp_path / "x.py"
    src.write_text('def f(d):\n    if "tool_calls" in d and d["tool_calls"] and d.get("reasoning_content"):\n'
                   '        return {"tool_calls": d["tool_calls"]}\n    d["reasoning_content"] = 1\n'
                   '    return dict(reasoning_field="reasoning_content")\n', encoding="utf-8")
    assert written_openai_fields(src) == ["reasoning_content", "reasoning_content", "tool_calls"]


def test_the_serving_layer_writes_no_openai_answer_fields():
    """The serving layer's answer is typed pieces (kvserve.serving.chat_output); the OpenAI face
    alone names them ``content`` / ``reasoning_content`` / ``tool_calls``."""
    found = {str(p.relative_to(ROOT)): w for p in sorted((ROOT / "serving").rglob("*.py"))
             if (w := written_openai_fields(p))}
    assert found == {}
