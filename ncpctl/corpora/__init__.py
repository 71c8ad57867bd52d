"""The built-in corpora (``builtin:python-stdlib``, ``builtin:python-packages``): which files they
are, from plain values (a path string, whether to include test suites). Below ``ncpctl.recipe``,
which checks a recipe's sources with them, and ``ncpctl.data``, which reads them."""
