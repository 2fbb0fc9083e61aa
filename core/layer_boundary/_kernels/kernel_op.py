"""``kernel_op``: a kernel callable that runs as itself in eager and as a registered
``torch.library`` custom operator under ``torch.compile``.

    launch = kernel_op("rmsnorm", launch, mutates=("out",))

registers ``<namespace>::rmsnorm`` (the namespace is the kernel's top-level package, e.g.
``layer_boundary_flashinfer``, unless the name carries one: ``"ns::rmsnorm"``) and returns the
kernel itself. Eager calls are plain Python calls: the dispatcher costs tens of microseconds a
call, more than a norm kernel at decode sizes, so nothing is added there. Dynamo, which cannot
trace into a vendor's launch (DLPack, data pointers, a C extension), is told to put the operator in
the graph in its place (``torch.compiler.substitute_in_graph``).

What crosses the operator's schema (the kernel's annotations):

| parameter annotation                      | schema          | notes                                  |
| ----------------------------------------- | --------------- | -------------------------------------- |
| ``Tensor``, ``Optional[Tensor]``          | ``Tensor(?)``   | written ones named in ``mutates``      |
| ``float``, ``int``, ``bool`` (optional)   | ``float`` ...   | ``weight_offset``, ``eps``, flags      |
| keyword-only (after ``*``)                | positional      | the call still passes them by keyword  |
| return ``None``                           | ``()``          | fake: nothing to allocate (derived)    |
| return ``Tensor`` / ``tuple[Tensor, ...]``| ``Tensor(s)``   | fresh tensors only; fake: see below    |

A destination keyword (``out=``, ``residual_out=``) is a declared mutation: write the kernel
destination-passing (it fills what it is given and returns ``None``) and allocate the destinations
in the plain Python around it, which Dynamo traces. A kernel that returns tensors must return new
ones (the operator may not return an alias of its inputs); its fake implementation is ``fake`` when
given, else the kernel itself run on fake tensors, which works for a kernel written in torch
operations and fails, with that advice, for one that launches a vendor kernel. Such a kernel (no
``fake=``) also stays differentiable: where autograd records (grad mode, an input that requires
grad) Dynamo traces the kernel's torch operations instead of the operator, which has no backward;
engines compile under ``no_grad`` / ``inference_mode`` and get the operator.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from typing import Any, Callable, Iterable, Optional, TypeVar, Union, get_args, get_origin

import torch

__all__ = ["kernel_op", "registered_op"]

F = TypeVar("F", bound=Callable[..., Any])

_SCALARS = (float, int, bool)
_OPS: dict[int, Any] = {}  # id(kernel) -> its operator (the kernel is kept alive by the polyfill)


def _is_tensor(annotation: Any) -> bool:
    if annotation is torch.Tensor:
        return True
    return get_origin(annotation) is Union and set(get_args(annotation)) == {torch.Tensor, type(None)}


def _check_param(kernel: Callable[..., Any], p: inspect.Parameter) -> None:
    a = p.annotation
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
        raise TypeError(f"kernel_op: {kernel.__qualname__} takes *{p.name}; a custom operator's schema names "
                        "every argument: spell them out")
    if a is inspect.Parameter.empty:
        raise TypeError(f"kernel_op: parameter {p.name!r} of {kernel.__qualname__} has no annotation; the "
                        "operator's schema is read from annotations (torch.Tensor, Optional[torch.Tensor], float, "
                        "int, bool)")
    scalar = a in _SCALARS or (get_origin(a) is Union and len(set(get_args(a)) - {type(None)}) == 1
                               and (set(get_args(a)) - {type(None)}).pop() in _SCALARS)
    if not (_is_tensor(a) or scalar):
        raise TypeError(f"kernel_op: parameter {p.name!r} of {kernel.__qualname__} is {a!r}; an operator takes "
                        "tensors, optional tensors, float, int and bool: pass a QuantizedRows as its two tensors "
                        "and a configuration as an index or its numbers")


def _namespaced(name: str, kernel: Callable[..., Any]) -> str:
    if "::" in name:
        return name
    return f"{kernel.__module__.split('.')[0]}::{name}"


def kernel_op(name: str, kernel: F, *, mutates: Iterable[str] = (),
              fake: Optional[Callable[..., Any]] = None) -> F:
    """Register ``kernel`` as the custom operator ``name`` (module docstring) and return it.

    ``mutates``: the tensor parameters the kernel writes (destinations, in-place residuals); an
    undeclared write is a wrong compiled program, which ``torch.library.opcheck`` finds. ``fake``:
    the operator's shapes-only implementation, needed only for a kernel that returns tensors and
    cannot run on fake tensors. Call it once per kernel, at import of the kernel's module.
    """
    if not isinstance(kernel, types.FunctionType):
        raise TypeError(f"kernel_op takes a plain function (module level, not a method or a partial), got "
                        f"{type(kernel).__name__}")
    qualified = _namespaced(name, kernel)
    sig = inspect.signature(kernel, eval_str=True)
    params = list(sig.parameters.values())
    for p in params:
        _check_param(kernel, p)
    written = tuple(mutates)
    for m in written:
        if m not in sig.parameters or not _is_tensor(sig.parameters[m].annotation):
            raise ValueError(f"kernel_op: {kernel.__qualname__} declares {m!r} written, which is not one of its "
                             f"tensor parameters ({', '.join(p.name for p in params if _is_tensor(p.annotation))})")
    try:
        # A custom operator takes no keyword-only tensor: every parameter becomes positional in
        # the schema; the substitute below maps the keywords of a call onto it.
        positional = sig.replace(parameters=[p.replace(kind=p.POSITIONAL_OR_KEYWORD) for p in params])
    except ValueError as e:
        raise TypeError(f"kernel_op: {kernel.__qualname__} has a keyword-only parameter without a default "
                        f"before one with a default ({e}); give it a default or make it positional") from e
    names = tuple(p.name for p in params)
    n_positional = sum(p.kind is not p.KEYWORD_ONLY for p in params)

    def body(*args: Any) -> Any:
        return kernel(*args[:n_positional], **dict(zip(names[n_positional:], args[n_positional:])))

    body.__signature__ = positional  # type: ignore[attr-defined]
    body.__name__ = kernel.__name__
    body.__module__ = kernel.__module__
    op = torch.library.custom_op(qualified, body, mutates_args=written)

    returns = sig.return_annotation
    mutation_only = returns is None or returns is type(None)
    if mutation_only:
        op.register_fake(_writes_only)
    else:
        op.register_fake(fake if fake is not None else _fake_by_running(qualified, body))
    # A kernel written in torch operations (its fake is itself) stays differentiable where autograd
    # records: the operator has no backward, so there Dynamo traces a copy of the kernel (the
    # kernel itself would be substituted again). Inference (no_grad, inference_mode) gets the op.
    inline = None if mutation_only or fake is not None else types.FunctionType(
        kernel.__code__, kernel.__globals__, kernel.__name__, kernel.__defaults__, kernel.__closure__)
    if inline is not None:
        inline.__kwdefaults__ = kernel.__kwdefaults__

    defaults = tuple(p.default for p in params)
    # The OpOverload, not the CustomOpDef: Dynamo builds a variable for the former from a closure.
    namespace, _, opname = qualified.partition("::")
    overload = getattr(getattr(torch.ops, namespace), opname).default

    def as_operator(*args: Any, **kwargs: Any) -> Any:
        # Traced by Dynamo, never run in eager: the call's keywords in schema order.
        full = list(args)
        for i in range(len(args), len(names)):
            full.append(kwargs.get(names[i], defaults[i]))
        if inline is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in full):
            return inline(*args, **kwargs)
        return overload(*full)

    _substitute(kernel, as_operator)
    _OPS[id(kernel)] = op
    return kernel


# -- telling Dynamo, without importing it ------------------------------------------------------------
# substitute_in_graph imports torch._dynamo, 1.4 s on this machine: a process that never compiles
# must not pay that for importing a kernel. Substitutions wait here until torch._dynamo is imported
# (by torch.compile, or anything else), and are made as its import completes, before it can trace.

_PENDING: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


def _substitute(kernel: Callable[..., Any], polyfill: Callable[..., Any]) -> None:
    if "torch._dynamo" in sys.modules and not _DynamoImported.waiting():
        torch.compiler.substitute_in_graph(kernel, skip_signature_check=True)(polyfill)
        return
    _PENDING.append((kernel, polyfill))
    _DynamoImported.install()


def _flush() -> None:
    while _PENDING:
        kernel, polyfill = _PENDING.pop(0)
        torch.compiler.substitute_in_graph(kernel, skip_signature_check=True)(polyfill)


class _DynamoImported(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch._dynamo`` as the other finders do and, once its module has run, makes the
    pending substitutions."""

    _installed: Optional["_DynamoImported"] = None

    @classmethod
    def install(cls) -> None:
        if cls._installed is None:
            cls._installed = cls()
            sys.meta_path.insert(0, cls._installed)

    @classmethod
    def waiting(cls) -> bool:
        """Whether torch._dynamo is being imported now (in sys.modules, its module not yet run)."""
        return cls._installed is not None and cls._installed._loading

    def __init__(self) -> None:
        self._loader: Any = None
        self._loading = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo" or self._loader is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loading = True
        try:
            self._loader.exec_module(module)
        finally:
            self._loading = False
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        _flush()


def registered_op(kernel: Callable[..., Any]) -> Optional[Any]:
    """The operator ``kernel_op`` registered for ``kernel`` (``None``: it registered none), for
    ``torch.library.opcheck``."""
    return _OPS.get(id(kernel))


def _writes_only(*args: Any) -> None:
    return None


def _fake_by_running(name: str, body: Callable[..., Any]) -> Callable[..., Any]:
    def fake(*args: Any) -> Any:
        try:
            return body(*args)
        except Exception as e:
            raise RuntimeError(
                f"{name} returns tensors and ran on fake tensors to learn their shapes, which failed "
                f"({type(e).__name__}: {e}); pass kernel_op(..., fake=...) that allocates the outputs with "
                "torch.empty(...) from the inputs' shapes, or make the kernel destination-passing (returns None)"
            ) from e

    return fake
