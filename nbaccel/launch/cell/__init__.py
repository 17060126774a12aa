"""What the launching cell sees of the workers' output.

``_output`` (whole lines, rank prefixes, progress bars in place) and ``_cell_output``
(a run's output stays in the cell that started it). Imports nothing of launch/.
"""
