"""`python -m zoo.plan`: the memory planner's command line. The API is `zoo.plan(...)`, from zoo/planner.py.

`import zoo` binds the function `zoo.plan`. Importing this module as well (`import zoo.plan`) makes Python bind
the name to the module instead, so the module is callable like the function: `zoo.plan(cfg, recipe, ...)` works
either way.
"""
import sys
import types

from zoo.planner import Plan, auto_recipe, main, plan  # noqa: F401


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
