"""One module per ``fedseg`` verb, each holding its parser (``add_<verb>_parser``) and its command
(``cmd_<verb>``), thin wrappers over library functions; :mod:`fedseg.cli` dispatches to them and
:mod:`fedseg.commands.options` holds the options several verbs share.

Every import is at the top: the modules they name defer their heavy dependencies into the
functions that use them, so ``fedseg --help`` loads none of matplotlib, NVFlare or TensorBoard.
"""
