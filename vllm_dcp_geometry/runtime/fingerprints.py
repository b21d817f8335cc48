# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Fingerprints of upstream source, so a pin sees a changed body.

A parameter list cannot see a function whose code changed behind the same
signature (vLLM 0.34.0's MLA a2a up-projection did exactly that). A
fingerprint is a hash of the symbol's syntax tree with docstrings, comments,
formatting and positions left out: any change to what the code does changes
it, a reworded docstring or a moved line does not.

What is hashed: a function's or class's own source; for a method a dataclass
generated (no source of its own), the class that generates it; for an object
(a kernel launcher), its class; for a plain value
(a constant, a field default), its type and ``repr``. No vLLM import.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import linecache
import sys
import textwrap
from typing import Any

from vllm_dcp_geometry.runtime.upstream_symbols import callable_of, original_of

FINGERPRINT_LENGTH = 16
"""Hex digits kept of the SHA-256: enough to tell two bodies apart."""

_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if not isinstance(node, _DOCSTRING_OWNERS):
            continue
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _tree_digest(tree: ast.Module) -> str:
    dumped = ast.dump(
        _strip_docstrings(tree), annotate_fields=True, include_attributes=False
    )
    return hashlib.sha256(dumped.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def source_digest(source: str) -> str:
    """The fingerprint of a piece of Python source (indented or not)."""
    return _tree_digest(ast.parse(textwrap.dedent(source)))


@functools.lru_cache(maxsize=8)
def _module_tree(filename: str) -> ast.Module:
    with open(filename, encoding="utf-8") as source:
        return ast.parse(source.read())


def class_digest(cls: type) -> str:
    """The fingerprint of a class's source, found in its module's syntax tree
    (parsed once per module: ``inspect.getsource`` parses the whole module
    again for every class, which start-up cannot afford)."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    node: ast.AST | None = _module_tree(filename) if filename else None
    for name in cls.__qualname__.split("."):
        body = getattr(node, "body", [])
        node = next(
            (n for n in body if isinstance(n, ast.ClassDef) and n.name == name),
            None,
        )
    if not isinstance(node, ast.ClassDef) or filename is None:
        # Defined at run time: let inspect find it or fail.
        return source_digest(inspect.getsource(cls))
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = linecache.getlines(filename)[first - 1 : node.end_lineno]
    return source_digest("".join(lines))


def _value_digest(value: Any) -> str:
    cls = type(value)
    if cls.__module__ != "builtins":
        # An object (a kernel launcher, say): its class's code says what it
        # does (its repr would name an address; what it holds can depend on
        # the process, an interpreted kernel or a CPU stand-in).
        return "instance:" + class_digest(cls)
    text = f"{cls.__qualname__}:{value!r}"
    return "value:" + hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def _source_object(owner: Any, raw: Any) -> Any:
    """What to read the source of: the upstream callable behind any wrapper
    of ours (a Triton kernel's Python function), or None for a plain value."""
    target = callable_of(original_of(raw))
    target = callable_of(original_of(target))
    func = getattr(target, "func", None)  # functools.cached_property
    if func is not None and not inspect.isroutine(target):
        target = func
    kernel_fn = getattr(target, "fn", None)  # a Triton JITFunction
    if kernel_fn is not None and not inspect.isroutine(target):
        target = kernel_fn
    if inspect.isroutine(target) or inspect.isclass(target):
        return target
    return None


def fingerprint(owner: Any, raw: Any) -> str:
    """The fingerprint of ``raw`` as defined on ``owner`` (see the module
    docstring for what is hashed)."""
    target = _source_object(owner, raw)
    if target is None:
        return _value_digest(raw)
    if inspect.isclass(target):
        return class_digest(target)
    code = getattr(target, "__code__", None)
    generated = code is not None and (
        code.co_filename.startswith("<") or code.co_filename == dataclasses.__file__
    )
    if generated and inspect.isclass(owner):
        # A method a dataclass generated: its class's source says what it does.
        return "class:" + class_digest(owner)
    # inspect reads a function's own lines (behind functools.wraps) only.
    return source_digest(inspect.getsource(target))
