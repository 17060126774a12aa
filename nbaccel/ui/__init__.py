"""Notebook front-ends: the ipywidgets launch panel and the live per-rank monitor.

ipywidgets is imported only when a widget is built. The public paths are
``nbaccel.widgets.LaunchPanel`` and ``nbaccel.monitor.watch``.
"""
