"""The package's layout: no import circle, the planner above the trainer, files one can read.

Every import statement of every module is read, those inside functions too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "jaxoffload"
MAX_LINES = 350


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
  """The package's modules that module ``name`` imports (a name imported from a package
  counts as its module where it is one)."""
  found = set()
  for node in ast.walk(ast.parse(MODULES[name].read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      for alias in node.names:
        module = f"{node.module}.{alias.name}"
        found.add(module if module in MODULES else node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
  return found & set(MODULES)


GRAPH = {name: _imports(name) for name in MODULES}


def _circle() -> list[str]:
  """One import circle (its modules in order), or [] where there is none."""
  done, path = set(), []

  def visit(name):
    if name in path:
      return path[path.index(name):] + [name]
    if name in done:
      return []
    path.append(name)
    for imported in sorted(GRAPH[name]):
      circle = visit(imported)
      if circle:
        return circle
    path.pop()
    done.add(name)
    return []

  for name in sorted(GRAPH):
    circle = visit(name)
    if circle:
      return circle
  return []


def test_the_graph_is_read():
  assert len(MODULES) > 60
  assert "jaxoffload.train.loop" in GRAPH["jaxoffload.train.__main__"]
  assert "jaxoffload.plan" in GRAPH["jaxoffload.train.__main__"]


def test_no_module_imports_itself_through_others():
  assert _circle() == []


def test_a_circle_is_found_where_there_is_one(monkeypatch):
  monkeypatch.setitem(GRAPH, "jaxoffload.nn.remat", {"jaxoffload.train.loop"})
  circle = _circle()
  assert circle[0] == circle[-1] and "jaxoffload.nn.remat" in circle


def test_only_the_trainers_entry_point_asks_the_planner():
  asking = {name for name, imported in GRAPH.items()
            if name.startswith("jaxoffload.train")
            and any(m.startswith("jaxoffload.plan") for m in imported)}
  assert asking == {"jaxoffload.train.__main__"}


@pytest.mark.parametrize("above", ["jaxoffload.train", "jaxoffload.plan", "jaxoffload.bench"])
def test_the_library_imports_nothing_of_the_trainer_planner_or_bench(above):
  users = {name for name, imported in GRAPH.items()
           if not name.startswith(("jaxoffload.train", "jaxoffload.plan", "jaxoffload.bench"))
           and any(m == above or m.startswith(above + ".") for m in imported)}
  assert users == set()


def test_no_module_of_the_trainer_is_the_planners():
  planner = {"fit", "ladder", "shallow", "compiling", "step_time", "search", "timing"}
  assert {p.stem for p in (PACKAGE / "train").rglob("*.py")} & planner == set()


def test_every_module_reads_in_one_sitting():
  long = {name: n for name, path in MODULES.items()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert long == {}
