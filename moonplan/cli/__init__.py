"""The ``moonplan`` command line: one module per subcommand, ``main`` puts them together.

``main.main`` is the console entry point (``moonplan ...``, ``python -m moonplan.cli ...``);
``args`` holds the shared argument checks, ``launch`` starts or joins the ranks of
``demo`` and ``profile``. Nothing is imported here, so a subcommand loads only what it uses.
"""
