"""Every cache the package keeps is listed in docs/index.md ("Caches"), with what drops it; the list holds no cache
that is gone (issue 65: one rule for every cache, written once and true).

A *cache* is state kept so that a later call skips work. The walk below finds three kinds, from the source:
- a module-level container (a dict, set, list or weak dictionary, or an instance of a class of the module) that the
  module writes after import;
- a memoizing decorator: ``functools.cache``, ``functools.lru_cache``, ``functools.cached_property``;
- an instance attribute computed on first use or filled by key: assigned under an ``if`` that asks whether it is
  ``None`` (or holds the key).

The last pattern also matches state that skips no work (an error kept, a deadline, a lease); :data:`NOT_CACHES` names
each with what it is instead, so that a new one is classified by whoever adds it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lightning_vllm"
INDEX = Path(__file__).parents[1] / "docs" / "index.md"

_CONTAINERS = {"dict", "set", "list", "WeakKeyDictionary", "WeakValueDictionary", "OrderedDict", "defaultdict"}
_WRITES = {"setdefault", "update", "add", "pop", "clear", "append", "discard", "popitem"}
_MEMOIZERS = {"cache", "lru_cache", "cached_property"}

NOT_CACHES = {
    "backends/gloo/group.py:Transfer._error": "a broadcast's error, kept to raise it again",
    "backends/gloo/group.py:StagingRing._buffer": "the staging memory, allocated on first use (bounded: one bucket)",
    "backends/lightning_ipc/trainer.py:KeptHandlesIPCTrainerEngine._landed": "the event of the last push's copies",
    "backends/registry.py:_REGISTRY": "the backends by name, registered at import as vLLM's factory does",
    "core/landing_check.py:LandingCheck._report": "the engine's answer to this push's question, asked once a push",
    "core/versions.py:WeightVersions._oldest_sampled": "the oldest version rollouts used since the last look",
    "core/weight_sync.py:WeightSync.model_metadata": "what the user or the first push declared",
    "engines/client.py:CommitWindow._paused_at": "when generation was paused",
    "engines/http.py:HTTPEngine.timeout_seconds": "the updater's timeout, followed by the engine",
    "fronts/lightning/push_points.py:PushPoints.ranks": "the trainer's status group, joined at fit start",
    "fronts/torchrl/scheme.py:VLLMWeightSender._updater": "the updater, built on first use",
    "server.py:PauseLease._expiry": "when a pause lease ends",
}


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _self_attribute(node: ast.AST) -> str | None:
    is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    return node.attr if is_self else None  # type: ignore[union-attr]


def _module_caches(tree: ast.Module) -> set[str]:
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    held: set[str] = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if not isinstance(target, ast.Name) or value is None:
            continue
        literal = isinstance(value, (ast.Dict, ast.Set, ast.List))
        made = isinstance(value, ast.Call) and (_name(value.func) in _CONTAINERS | classes)
        if literal or made:
            held.add(target.id)
    written = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            written.add(_name(node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _WRITES:
            written.add(_name(node.func.value))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            written.add(_name(node.value))  # (an instance's attribute set: `_fused_sums.usable = False`)
    return {name for name in held if name in written}


def _memoized(tree: ast.Module) -> set[str]:
    found = set()
    for scope in [tree, *(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef))]:
        prefix = f"{scope.name}." if isinstance(scope, ast.ClassDef) else ""
        for node in scope.body:
            decorated = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list
            if decorated and any(_name(getattr(d, "func", d)) in _MEMOIZERS for d in node.decorator_list):
                found.add(prefix + node.name)
    return found


def _computed_once(tree: ast.Module) -> set[str]:
    found = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for branch in (node for node in ast.walk(cls) if isinstance(node, ast.If)):
            asked = {
                _self_attribute(compare.left) if isinstance(compare.ops[0], (ast.Is, ast.IsNot)) else
                _self_attribute(compare.comparators[0]) if isinstance(compare.ops[0], (ast.In, ast.NotIn)) else None
                for compare in ast.walk(branch.test) if isinstance(compare, ast.Compare)
            } - {None}  # fmt: skip
            for statement in branch.body:
                for node in ast.walk(statement):
                    for target in getattr(node, "targets", []):
                        attribute = _self_attribute(target.value if isinstance(target, ast.Subscript) else target)
                        if attribute in asked:
                            found.add(f"{cls.name}.{attribute}")
    return found


def found_caches() -> set[str]:
    """``path:name`` of every cache the walk finds (see the module docstring), the state of NOT_CACHES included."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE).as_posix()
        found |= {f"{where}:{name}" for name in _module_caches(tree) | _memoized(tree) | _computed_once(tree)}
    return found


def defines(tree: ast.Module, name: str) -> bool:
    """Whether ``tree`` defines ``name``: a module-level name, or ``Class.attribute`` (a method, a class attribute, or
    an attribute its methods set on ``self``)."""
    scope, _, attribute = name.rpartition(".")
    if not scope:
        return any(
            isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and node.name == name
            or isinstance(node, (ast.Assign, ast.AnnAssign))
            and any(_name(t) == name for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
            for node in tree.body
        )
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == scope), None)
    return cls is not None and any(
        getattr(node, "name", None) == attribute
        or isinstance(node, ast.AnnAssign)
        and _name(node.target) == attribute
        or isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and _self_attribute(node) == attribute
        for node in ast.walk(cls)
    )


def listed_caches() -> set[str]:
    """The caches docs/index.md lists: the first column of its "Caches" table, ``path:name``."""
    text = INDEX.read_text()
    section = text[text.index("## Caches") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    return set(re.findall(r"^\| `([\w/]+\.py:[\w.]+)` \|", section, flags=re.MULTILINE))


def test_every_cache_is_listed_with_what_drops_it_and_every_listed_one_is_there():
    found = found_caches()
    listed = listed_caches()
    unlisted = sorted(found - listed - NOT_CACHES.keys())
    assert unlisted == [], "a cache without its rule: list it in docs/index.md's Caches (or NOT_CACHES, saying why)"
    gone = [
        entry for entry in sorted(listed)
        if not defines(ast.parse((PACKAGE / entry.split(":")[0]).read_text()), entry.split(":")[1])
    ]  # fmt: skip
    assert gone == [], "listed in docs/index.md's Caches, but no longer in the package"
    assert sorted(NOT_CACHES.keys() - found) == [], "gone from the package: drop it from NOT_CACHES"


def test_the_walk_finds_each_kind_of_cache():
    """The three patterns, each in a few lines, so that the walk above cannot pass by finding nothing."""
    source = """
import functools
_seen = {}
_constant = {"a": 1}
def remember(key):
    _seen[key] = 1
@functools.cache
def compute(): ...
class Engine:
    def __init__(self):
        self._facts = None
    @functools.cached_property
    def config(self): ...
    def facts(self):
        if self._facts is None:
            self._facts = 1
        return self._facts
"""
    tree = ast.parse(source)
    assert _module_caches(tree) == {"_seen"}
    assert _memoized(tree) == {"compute", "Engine.config"}
    assert _computed_once(tree) == {"Engine._facts"}
