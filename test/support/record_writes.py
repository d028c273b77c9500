"""Where the package's records are written from outside the module that owns them, read
from its source with `ast` (for `test_package_rules.py`).

A record is a class of the package decorated `@dataclass`; its owner is the module that
defines it. A write is an attribute assignment `x.field = ...` (`+=` and the like, and a
name inside a tuple target, included) whose `x` is known to be an instance of a record:
the type of `x` is read from the type hints the package's style asks for, the way a type
checker reads them, within a function:

- a parameter's annotation, `self` (the class the method is in), a local variable's
  annotation or what was assigned to it (a record's constructor, a call with a return
  annotation, another expression typed by these rules), a `for` target over a typed
  container (`list[X]`, `dict[K, V].values()` / `.items()`, ...);
- `enumerate(...)` and `zip(...)` of typed containers, unpacked;
- `a.b`: the attribute `b` of the type of `a` (a field, an attribute `self.b` set in its
  class with a known type, a property's return annotation); `a.m(...)`: the method's
  return annotation; `a[i]`, `d.get(k)`, `d.pop(k)`: the container's item type;
- `X | None`, `Optional[X]` and the branches of `a if c else b` / `a or b`: any of them.

A class made at a module's top by a call handed a record (`server/messages.py`:
`X = _message("X", wire.Y)`, the IPC message carrying the wire model's fields) is that
record.

An expression of no known type is not checked (an untyped parameter, what a library
returns): the check never guesses, so what it reports is a write it can prove."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from package_source import MODULES, NAME

ClassKey = tuple[str, str]  # (module, class name)
_SEQUENCES = {
    "list",
    "set",
    "frozenset",
    "Sequence",
    "MutableSequence",
    "Iterable",
    "Iterator",
    "Collection",
    "deque",
    "Set",
    "AbstractSet",
    "KeysView",
    "ValuesView",
}
_MAPPINGS = {"dict", "Mapping", "MutableMapping", "OrderedDict", "defaultdict"}
_OPTIONAL = {"Optional", "ClassVar", "Final", "Annotated"}


@dataclass(frozen=True)
class Seq:
    item: frozenset


@dataclass(frozen=True)
class Map:
    key: frozenset
    value: frozenset


@dataclass(frozen=True)
class Tup:
    items: tuple[frozenset, ...]


Type = frozenset  # of ClassKey | Seq | Map | Tup
NOTHING: Type = frozenset()


@dataclass
class ClassInfo:
    key: ClassKey
    node: ast.ClassDef
    record: bool
    bases: list[ClassKey] = field(default_factory=list)


@dataclass(frozen=True)
class RecordWrite:
    module: str  # where the write is
    line: int
    record: ClassKey
    attribute: str

    def __str__(self) -> str:
        owner, name = self.record
        return (
            f"{self.module.removeprefix(NAME + '.')}:{self.line} sets {name}.{self.attribute} "
            f"({name} is {owner.removeprefix(NAME + '.')}'s)"
        )


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if getattr(target, "id", getattr(target, "attr", None)) == "dataclass":
            return True
    return False


class Package:
    """Every class and module-level function of the package, and each module's names."""

    def __init__(self, modules: dict[str, ast.Module]):
        self.modules = modules
        self.classes: dict[ClassKey, ClassInfo] = {}
        self.functions: dict[tuple[str, str], ast.FunctionDef | ast.AsyncFunctionDef] = {}
        for module, tree in modules.items():
            for node in ast.walk(tree):  # (a class made inside a function too)
                if isinstance(node, ast.ClassDef):
                    key = (module, node.name)
                    self.classes.setdefault(key, ClassInfo(key, node, _is_dataclass(node)))
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    self.functions[(module, node.name)] = node
        # Classes made by a call from a record (`X = f(..., Record)`), read once every
        # module's imports are known; then the names again, with them.
        self.made: dict[ClassKey, ClassKey] = {}
        self.names = {module: self._names(module, tree) for module, tree in modules.items()}
        self.made = self._made_classes()
        self.names = {module: self._names(module, tree) for module, tree in modules.items()}
        for info in self.classes.values():
            namespace = self.names[info.key[0]]
            for base in info.node.bases:
                found = namespace.resolve(base)
                if isinstance(found, tuple):
                    info.bases.append(found)
        self._attributes: dict[tuple[ClassKey, str], Type] = {}
        self._busy: set[tuple[ClassKey, str]] = set()

    def _names(self, module: str, tree: ast.Module) -> Namespace:
        namespace = Namespace(self, module)
        for key in self.classes:
            if key[0] == module:
                namespace.bound[key[1]] = key
        for key in self.functions:
            if key[0] == module:
                namespace.bound.setdefault(key[1], ("function", key))
        for (made_in, name), record in self.made.items():
            if made_in == module:
                namespace.bound.setdefault(name, record)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    local = alias.asname or alias.name
                    dotted = f"{node.module}.{alias.name}"
                    if dotted in self.modules:
                        namespace.bound[local] = ("module", dotted)
                        continue
                    target = self._module_of(dotted)
                    if target is None:
                        continue
                    namespace.bound[local] = self._exported(target, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.modules and alias.asname:
                        namespace.bound[alias.asname] = ("module", alias.name)
        return namespace

    def _made_classes(self) -> dict[ClassKey, ClassKey]:
        """(module, name) -> the record a top-level `name = f(..., Record)` makes."""
        made: dict[ClassKey, ClassKey] = {}
        for module, tree in self.modules.items():
            for node in tree.body:
                if not (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Call)
                ):
                    continue
                for argument in node.value.args:
                    found = self.names[module].resolve(argument)
                    if isinstance(found, tuple) and found in self.classes:
                        if self.classes[found].record:
                            made[(module, node.targets[0].id)] = found
        return made

    def _module_of(self, dotted: str) -> str | None:
        """The module of ours an import names (`pkg.mod.Name` -> `pkg.mod`), else None."""
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _exported(self, module: str, name: str) -> object:
        """What `from module import name` binds: a class or function defined there, or
        one it imports in turn (a package's `__init__` handing names on)."""
        if (module, name) in self.classes:
            return (module, name)
        if (module, name) in self.made:
            return self.made[(module, name)]
        if (module, name) in self.functions:
            return ("function", (module, name))
        for node in ast.walk(self.modules[module]):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = self._module_of(f"{node.module}.{alias.name}")
                        if target is not None and target != module:
                            return self._exported(target, alias.name)
        return None

    # ------------------------------------------------------------------ attributes

    def attribute(self, key: ClassKey, name: str) -> Type:
        """The type of attribute `name` of an instance of `key` (its bases' too)."""
        memo = (key, name)
        if memo in self._attributes:
            return self._attributes[memo]
        if memo in self._busy:
            return NOTHING
        self._busy.add(memo)
        try:
            found = self._own_attribute(key, name)
            for base in self.classes[key].bases:
                if not found:
                    found = self.attribute(base, name)
        finally:
            self._busy.discard(memo)
        self._attributes[memo] = found
        return found

    def _own_attribute(self, key: ClassKey, name: str) -> Type:
        info = self.classes[key]
        namespace = self.names[key[0]]
        found: set = set()
        for statement in info.node.body:
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and statement.target.id == name
            ):
                found |= namespace.annotation(statement.annotation)
            elif (
                isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef)
                and statement.name == name
                and statement.returns is not None
                and any(_is_property(d) for d in statement.decorator_list)
            ):
                found |= namespace.annotation(statement.returns)
        if found:
            return frozenset(found)
        for method in info.node.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            scope = Scope(namespace, method, key)
            for node in ast.walk(method):
                if isinstance(node, ast.AnnAssign) and _is_self_attribute(node.target, name):
                    found |= namespace.annotation(node.annotation)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        if _is_self_attribute(target, name):
                            found |= scope.type_of(node.value)
        return frozenset(found)

    def method(self, key: ClassKey, name: str) -> tuple[ast.FunctionDef, str] | None:
        """The method `name` of `key` (or of a base), and the module it is in."""
        for statement in self.classes[key].node.body:
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
                if statement.name == name:
                    return statement, key[0]
        for base in self.classes[key].bases:
            found = self.method(base, name)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ writes

    def writes(self) -> Iterator[RecordWrite]:
        """Every write to a record outside the module that owns it."""
        for module, tree in self.modules.items():
            namespace = self.names[module]
            for function, owner in _functions(tree, module):
                scope = Scope(namespace, function, owner)
                for target, line in _assigned_attributes(function):
                    for record in scope.type_of(target.value):
                        if (
                            isinstance(record, tuple)
                            and self.classes[record].record
                            and record[0] != module
                        ):
                            yield RecordWrite(module, line, record, target.attr)


def _is_property(decorator: ast.expr) -> bool:
    name = getattr(decorator, "id", getattr(decorator, "attr", None))
    return name in {"property", "cached_property"}


def _is_self_attribute(node: ast.expr, name: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _functions(
    tree: ast.Module, module: str
) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ClassKey | None]]:
    """Every function of a module (nested ones too), with the class a method is in."""

    def visit(node: ast.AST, owner: ClassKey | None) -> Iterator:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, (module, child.name))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield child, owner
                yield from visit(child, None)
            else:
                yield from visit(child, owner)

    yield from visit(tree, None)


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions and classes inside it
    (each is a scope of its own; a lambda's body stays: it reads this scope's names)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.expr) -> Iterator[ast.expr]:
    if isinstance(node, ast.Tuple | ast.List):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _assigned_attributes(function: ast.AST) -> Iterator[tuple[ast.Attribute, int]]:
    for node in _own_nodes(function):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute):
                yield target, target.lineno


class Namespace:
    """The names one module binds at its top: its classes and functions, and what it
    imports of the package."""

    def __init__(self, package: Package, module: str):
        self.package = package
        self.module = module
        self.bound: dict[str, object] = {}

    def resolve(self, node: ast.expr) -> object:
        """What a name or `module.name` in this module stands for (None: not ours)."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            bound = self.bound.get(node.value.id)
            if isinstance(bound, tuple) and bound[0] == "module":
                return self.package._exported(bound[1], node.attr)
        return None

    def annotation(self, node: ast.expr | None) -> Type:
        """The types an annotation names."""
        if node is None:
            return NOTHING
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.annotation(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return NOTHING
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.annotation(node.left) | self.annotation(node.right)
        if isinstance(node, ast.Subscript):
            return self._generic(node)
        found = self.resolve(node)
        if isinstance(found, tuple) and found in self.package.classes:
            return frozenset({found})
        return NOTHING

    def _generic(self, node: ast.Subscript) -> Type:
        head = node.value
        name = getattr(head, "id", getattr(head, "attr", ""))
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if name in _OPTIONAL or name == "Union":
            return frozenset().union(*(self.annotation(a) for a in args[:1] if name != "Union"))
        if name in _SEQUENCES:
            return frozenset({Seq(self.annotation(args[0]))})
        if name in _MAPPINGS and len(args) == 2:
            return frozenset({Map(self.annotation(args[0]), self.annotation(args[1]))})
        if name == "tuple":
            if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is ...:
                return frozenset({Seq(self.annotation(args[0]))})
            return frozenset({Tup(tuple(self.annotation(a) for a in args))})
        return NOTHING


class Scope:
    """The names one function binds, typed as the module docstring says."""

    def __init__(
        self,
        namespace: Namespace,
        function: ast.FunctionDef | ast.AsyncFunctionDef,
        owner: ClassKey | None,
    ):
        self.namespace = namespace
        self.package = namespace.package
        self.bindings: dict[str, list[tuple[str, ast.AST]]] = {}
        arguments = function.args
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            self._bind(argument.arg, "annotation", argument.annotation)
        if owner is not None and arguments.args and arguments.args[0].arg == "self":
            self.bindings["self"] = [("class", owner)]  # type: ignore[list-item]
        for node in _own_nodes(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    self._bind_target(target, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self._bind(node.target.id, "annotation", node.annotation)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                each = ast.Subscript(ast.Call(ast.Name("iter"), [node.iter], []), ast.Name("_"))
                self._bind_target(node.target, each)
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target.id, "value", node.value)
        self._busy: set[str] = set()

    def _bind(self, name: str, how: str, node: ast.AST | None) -> None:
        if node is not None:
            self.bindings.setdefault(name, []).append((how, node))

    def _bind_target(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Name):
            self._bind(target.id, "value", value)
        elif isinstance(target, ast.Tuple | ast.List):
            for index, element in enumerate(target.elts):
                item = ast.Subscript(value, ast.Constant(index))
                self._bind_target(element, item)

    def name(self, name: str) -> Type:
        if name in self._busy:
            return NOTHING
        self._busy.add(name)
        try:
            found: set = set()
            for how, node in self.bindings.get(name, []):
                if how == "class":
                    found.add(node)
                elif how == "annotation":
                    found |= self.namespace.annotation(node)  # type: ignore[arg-type]
                else:
                    found |= self.type_of(node)  # type: ignore[arg-type]
            return frozenset(found)
        finally:
            self._busy.discard(name)

    def type_of(self, node: ast.expr) -> Type:
        """The types `node` may evaluate to (empty: unknown)."""
        if isinstance(node, ast.Name):
            return self.name(node.id)
        if isinstance(node, ast.Attribute):
            return frozenset().union(
                *(
                    self.package.attribute(t, node.attr)
                    for t in self.type_of(node.value)
                    if isinstance(t, tuple)
                )
            )
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.Subscript):
            return self._item(self.type_of(node.value), node.slice)
        if isinstance(node, ast.IfExp):
            return self.type_of(node.body) | self.type_of(node.orelse)
        if isinstance(node, ast.BoolOp):
            return frozenset().union(*(self.type_of(v) for v in node.values))
        if isinstance(node, ast.Await):
            return self.type_of(node.value)
        if isinstance(node, ast.NamedExpr):
            return self.type_of(node.value)
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
            return frozenset({Seq(self.type_of(node.elt))})
        if isinstance(node, ast.List | ast.Set) and node.elts:
            return frozenset({Seq(frozenset().union(*(self.type_of(e) for e in node.elts)))})
        if isinstance(node, ast.Tuple):
            return frozenset({Tup(tuple(self.type_of(e) for e in node.elts))})
        return NOTHING

    def _call(self, node: ast.Call) -> Type:
        func = node.func
        if isinstance(func, ast.Name) and func.id in {"iter", "list", "sorted", "reversed"}:
            return self._iterated(node.args[0]) if node.args else NOTHING
        if isinstance(func, ast.Name) and func.id == "next" and node.args:
            return self._item(self._iterated(node.args[0]), None)
        if isinstance(func, ast.Name) and func.id == "enumerate" and node.args:
            items = self._item(self._iterated(node.args[0]), None)
            return frozenset({Seq(frozenset({Tup((NOTHING, items))}))})
        if isinstance(func, ast.Name) and func.id == "zip":
            columns = tuple(self._item(self._iterated(a), None) for a in node.args)
            return frozenset({Seq(frozenset({Tup(columns)}))})
        found = self.namespace.resolve(func) if isinstance(func, ast.Name) else None
        if found is None and isinstance(func, ast.Attribute):
            found = self.namespace.resolve(func)
        if isinstance(found, tuple) and found in self.package.classes:
            return frozenset({found})  # a constructor
        if isinstance(found, tuple) and found[0] == "function":
            module, name = found[1]
            returns = self.package.functions[(module, name)].returns
            return self.package.names[module].annotation(returns)
        if not isinstance(func, ast.Attribute):
            return NOTHING
        receiver = self.type_of(func.value)
        found_types: set = set()
        for t in receiver:
            if isinstance(t, tuple):
                method = self.package.method(t, func.attr)
                if method is not None:
                    definition, module = method
                    found_types |= self.package.names[module].annotation(definition.returns)
            elif isinstance(t, Map) and func.attr in {"get", "pop", "setdefault"}:
                found_types |= t.value
            elif isinstance(t, Map) and func.attr == "values":
                found_types.add(Seq(t.value))
            elif isinstance(t, Map) and func.attr == "items":
                found_types.add(Seq(frozenset({Tup((t.key, t.value))})))
            elif isinstance(t, Seq) and func.attr == "pop":
                found_types |= t.item
        return frozenset(found_types)

    def _iterated(self, node: ast.expr) -> Type:
        """What iterating `node` gives, as a sequence type."""
        found: set = set()
        for t in self.type_of(node):
            if isinstance(t, Seq):
                found.add(t)
            elif isinstance(t, Map):
                found.add(Seq(t.key))
        return frozenset(found)

    def _item(self, container: Type, index: ast.expr | None) -> Type:
        found: set = set()
        for t in container:
            if isinstance(t, Seq):
                found |= t.item
            elif isinstance(t, Map):
                found |= t.value
            elif isinstance(t, Tup) and isinstance(index, ast.Constant):
                if isinstance(index.value, int) and -len(t.items) <= index.value < len(t.items):
                    found |= t.items[index.value]
        return frozenset(found)


def record_writes(modules: dict[str, ast.Module] | None = None) -> list[RecordWrite]:
    """Every write to one of the package's records outside its owning module."""
    return sorted(
        Package(MODULES if modules is None else modules).writes(),
        key=lambda w: (w.module, w.line, w.attribute),
    )
