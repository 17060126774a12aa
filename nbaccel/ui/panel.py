"""``LaunchPanel``: configure and launch a training function from an ipywidgets panel.

The controls are derived from :class:`nbaccel.config.LaunchConfig` (its fields,
``Literal`` choices, minimums and docstring), the starting values from
:func:`nbaccel.config.resolve_launch_config` (environment and config file), so the
panel, the YAML file and the ``nbaccel`` command always agree.

Multi-node: run the same cell on every machine and give each its own node rank.

Example:
    >>> from nbaccel.widgets import LaunchPanel  # doctest: +SKIP
    >>> def train(lr):
    ...     from nbaccel import Accelerator
    ...     accelerator = Accelerator()
    ...     accelerator.print("training with", lr)
    >>> panel = LaunchPanel(train, args=(0.1,))  # doctest: +SKIP
    >>> panel  # displays the panel; click Launch, or:  # doctest: +SKIP
    >>> panel.launch()  # doctest: +SKIP
"""

from __future__ import annotations

import html
import re
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets

from ..config import (
    INT_MINIMUMS,
    MAX_PORT,
    LaunchConfig,
    default_config_path,
    field_help,
    field_kind,
    field_names,
    resolve_launch_config,
    save_config,
)
from ..config.store import with_host_defaults
from ..errors import ConfigError
from ..platform.hardware import (
    Hardware,
    default_num_processes,
    detect_hardware,
    notebook_host,
)
from .monitor import RunMonitor

_MULTI_NODE = ("node_rank", "master_addr", "master_port")
_INT_MAXIMUMS = {
    "master_port": MAX_PORT,
    "fsdp_min_num_params": 10**15,
}  # others: effectively unbounded, kept sane for typing
_SANE_MAX = 4096
_STYLE = {"description_width": "190px"}
_ROW_WIDTH = "360px"  # a fresh Layout per control: no widget may be created at import time


def _label(name: str) -> str:
    return name.replace("_", " ")


class OutputSink:
    """A file-like object that shows what is written to it in an ``Output`` widget.

    The launcher writes the workers' lines here (``output=`` of ``notebook_launcher``),
    from its forwarding thread. Carriage returns redraw the last line, so text
    progress bars update in place; only the last ``max_lines`` lines are kept.
    """

    def __init__(self, output: widgets.Output, max_lines: int = 1000) -> None:
        self.output = output
        self.max_lines = max_lines
        self._lines: list[str] = [""]
        self._return = False
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for piece in re.split(r"(\r\n|\r|\n)", text):
                if piece in ("\n", "\r\n"):
                    self._lines.append("")
                    self._return = False
                elif piece == "\r":
                    self._return = True  # the next text overwrites this line (a redraw)
                elif piece:
                    if self._return:
                        self._lines[-1], self._return = "", False
                    self._lines[-1] += piece
            del self._lines[: -self.max_lines]
            self.output.outputs = (
                {"output_type": "stream", "name": "stdout", "text": "\n".join(self._lines)},
            )
        return len(text)

    def flush(self) -> None:
        pass

    def clear(self) -> None:
        with self._lock:
            self._lines, self._return = [""], False
            self.output.outputs = ()

    def getvalue(self) -> str:
        return "\n".join(self._lines)


class LaunchPanel(widgets.VBox):
    """A panel with a control per launch setting, Launch and Save-as-default buttons.

    Args:
        training_function: the function every process runs (as for ``notebook_launcher``).
        args: positional arguments for it.
        config: starting values (default: arguments > NBACCEL_* env > config file).
        launcher_kwargs: extra keyword arguments for ``notebook_launcher`` (e.g. ``output``,
            ``return_all_ranks``); the seam the live view plugs into.
        pool: a warm :class:`~nbaccel.WorkerPool`: Launch runs the function on its
            workers (``pool.run``) instead of starting new ones; the pool's own settings
            apply, the controls are not used for the run.

    Attributes:
        controls: ``{field: widget}`` for every LaunchConfig field.
        messages: ``{field: HTML}`` where a field's problem is shown.
        output: the ``Output`` area where the run's per-rank output appears.
        sink: the :class:`OutputSink` that writes the workers' lines into ``output``
            (passed as ``output=`` to the launcher unless ``launcher_kwargs`` has one).
    """

    def __init__(
        self,
        training_function: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        config: LaunchConfig | None = None,
        launcher_kwargs: Mapping[str, Any] | None = None,
        hardware: Hardware | None = None,
        pool: Any = None,
    ) -> None:
        if not callable(training_function):
            raise TypeError(f"training_function must be callable, got {training_function!r}.")
        self.training_function = training_function
        self.args = tuple(args)
        self.launcher_kwargs = dict(launcher_kwargs or {})
        self.pool = pool
        self.hardware = hardware or detect_hardware()
        self.result: Any = None
        note = ""
        if config is None:
            try:
                config = resolve_launch_config()
            except ConfigError as err:  # a broken file must not hide the panel
                config, note = LaunchConfig(), f"Ignoring the saved config: {err}"
        # Colab's TPU v5e-1: 1 process; Kaggle's v5e-8: 8; Kaggle's 2 x T4: 2 and fp16.
        self.host = notebook_host()
        config = with_host_defaults(config, self.host, self.hardware.kind)
        if config.num_processes is None:
            config = config.replace(
                num_processes=default_num_processes(config.compute_device, config.gpu_ids)
            )
        self.controls: dict[str, widgets.ValueWidget] = {}
        self.messages: dict[str, widgets.HTML] = {}
        self.rows: dict[str, widgets.HBox] = {}
        for name in field_names():
            self.controls[name] = self._make_control(name, getattr(config, name))
            self.messages[name] = widgets.HTML(layout=widgets.Layout(margin="0 0 0 12px"))
            self.rows[name] = widgets.HBox([self.controls[name], self.messages[name]])
        self.launch_button = widgets.Button(
            description="Launch",
            button_style="success",
            icon="play",
            tooltip="Run on all processes",
        )
        self.save_button = widgets.Button(
            description="Save as default", icon="save", tooltip=str(default_config_path())
        )
        self.status = widgets.HTML(html.escape(note))
        self.output = widgets.Output(
            layout=widgets.Layout(border="1px solid #ddd", min_height="2em", padding="4px")
        )
        self.sink = OutputSink(self.output)
        # the live per-rank view (state, step, latest logged scalars, rank 0's progress),
        # the same component as nbaccel.monitor.watch(handle) in a plain cell
        self.monitor = RunMonitor(widget=True, stream=None)
        self.launch_button.on_click(lambda _button: self._on_launch_click())
        self.save_button.on_click(lambda _button: self._on_save_click())
        for control in self.controls.values():
            control.observe(lambda _change: self._refresh(), names="value")
        super().__init__(
            children=[
                widgets.HTML(
                    f"<b>nbaccel launch</b> &middot; <code>{html.escape(_function_name(training_function))}"
                    f"</code><br><b>Hardware:</b> {html.escape(self.hardware.summary())}"
                    f" &middot; {html.escape(self.host.label)}"
                ),
                *self.rows.values(),
                widgets.HBox([self.launch_button, self.save_button, self.status]),
                self.monitor.widget,
                self.output,
            ]
        )
        self.add_class("nbaccel-launch-panel")
        self._refresh()

    # ------------------------------------------------------------------ building
    def _make_control(self, name: str, value: Any) -> widgets.ValueWidget:
        kind, choices = field_kind(name)
        common: dict[str, Any] = {
            "description": _label(name),
            "tooltip": field_help().get(name, ""),
            "style": _STYLE,
            "layout": widgets.Layout(width=_ROW_WIDTH),
        }
        if choices:
            return widgets.Dropdown(options=list(choices), value=value, **common)
        if kind is bool:
            return widgets.Checkbox(value=bool(value), indent=True, **common)
        if kind is int:
            minimum = INT_MINIMUMS.get(name, 0)
            maximum = _INT_MAXIMUMS.get(name, _SANE_MAX)
            if value is None:  # master_port: shown only for several nodes, where it is required
                value = 29500
            return widgets.BoundedIntText(value=value, min=minimum, max=maximum, **common)
        if kind is float:  # timeout; 0 means "no timeout"
            common["description"] = f"{_label(name)} (s, 0 = none)"
            return widgets.BoundedFloatText(value=value or 0.0, min=0.0, max=1e7, **common)
        placeholder = "all" if name == "gpu_ids" else "none"
        return widgets.Text(value=value or "", placeholder=placeholder, **common)

    # ------------------------------------------------------------------ state
    def _values(self) -> dict[str, Any]:
        values = {name: control.value for name, control in self.controls.items()}
        if values["num_nodes"] == 1:  # one machine: the launcher picks a free port
            values["node_rank"], values["master_port"] = 0, None
        for name in ("gpu_ids", "fsdp_transformer_cls_names_to_wrap"):
            values[name] = (values[name] or "").strip() or None
        values["timeout"] = values["timeout"] or None
        return values

    @property
    def config(self) -> LaunchConfig:
        """The :class:`LaunchConfig` the controls describe (raises ``ConfigError`` if invalid)."""
        return LaunchConfig(**self._values())

    def problems(self) -> dict[str, str]:
        """``{field or "": reason}`` for everything that currently prevents a launch."""
        try:
            cfg = self.config
        except ConfigError as err:
            fields = [n for n in re.findall(r"\b([a-z_]+)=", str(err)) if n in self.controls]
            return {fields[0] if fields else "": str(err)}
        found: dict[str, str] = {}
        gpus = self.hardware.device_count if self.hardware.kind == "gpu" else 0
        if cfg.compute_device == "gpu" and gpus == 0:
            found["compute_device"] = "no CUDA GPU is visible here; choose cpu or auto."
        elif cfg.compute_device == "tpu" and self.hardware.kind != "tpu":
            found["compute_device"] = "no TPU (with torch_xla) is visible here."
        elif cfg.compute_device in ("gpu", "auto") and 0 < gpus < (cfg.num_processes or 1):
            found["num_processes"] = (
                f"only {gpus} GPU(s) are visible: use at most {gpus} processes per node."
            )
        if cfg.strategy == "fsdp" and (cfg.num_processes or 1) * cfg.num_nodes < 2:
            found["strategy"] = "fsdp shards across processes: use 2 or more processes."
        return found

    def _refresh(self) -> None:
        nodes = self.controls["num_nodes"].value
        rank = self.controls["node_rank"]
        rank.max = max(nodes - 1, 0)  # clamps the value too
        for name in _MULTI_NODE:
            self.rows[name].layout.display = None if nodes > 1 else "none"
        uses_gpu = self.controls["compute_device"].value == "gpu" or (
            self.controls["compute_device"].value == "auto" and self.hardware.kind == "gpu"
        )
        self.rows["gpu_ids"].layout.display = None if uses_gpu else "none"
        fsdp = self.controls["strategy"].value == "fsdp"  # its options only when chosen
        for name in self.rows:
            if name.startswith("fsdp_"):
                self.rows[name].layout.display = None if fsdp else "none"
        found = self.problems()
        for name, message in self.messages.items():
            text = found.get(name, "")
            message.value = (
                f"<span style='color:#c62828'>{html.escape(text)}</span>" if text else ""
            )
        self.launch_button.disabled = bool(found)
        self.launch_button.tooltip = "; ".join(found.values()) or "Run on all processes"
        if "" in found:
            self.status.value = f"<span style='color:#c62828'>{html.escape(found[''])}</span>"

    # ------------------------------------------------------------------ actions
    def save(self, path: Any = None) -> Any:
        """Save the panel's config as the default (or to ``path``); return the path."""
        written = save_config(self.config, path)
        self.status.value = f"Saved to <code>{html.escape(str(written))}</code>"
        return written

    def launch(self, **kwargs: Any) -> Any:
        """Do what the Launch button does: run the function with the panel's config.

        Calls ``nbaccel.launcher.notebook_launcher(fn, args, config=panel.config, ...)``
        with the run's output shown in :attr:`output`; returns its result and raises
        its errors (the button shows them in the output area instead).
        """
        found = self.problems()
        if found:
            raise ConfigError("; ".join(found.values()))
        cfg = self.config
        from ..launch import launcher  # imported late: the launcher pulls in torch

        self.launch_button.disabled = True
        self.status.value = f"Running on {cfg.num_processes} process(es) per node&hellip;"
        self.sink.clear()
        # Every line names its rank (the launcher's default prefixes only once two ranks print).
        options = {
            "output": self.sink,
            "log_line_prefix_template": "[rank{rank}] ",
            **self.launcher_kwargs,
            **kwargs,
        }
        # Always start in the background so the live view can follow the run; a blocking
        # launch (the default) then waits here, as notebook_launcher(block=True) would.
        block = bool(options.pop("block", True))
        try:
            # Output printed by the kernel itself (warnings, errors) lands here too.
            with self.output:
                if self.pool is not None:  # warm workers: no new processes
                    own = {k: options[k] for k in ("output", "return_all_ranks") if k in options}
                    handle = self.pool.call(self.training_function, self.args, block=False, **own)
                else:
                    handle = launcher.notebook_launcher(
                        self.training_function, self.args, config=cfg, block=False, **options
                    )
            self.monitor.attach(handle)
            if not block:
                self.result = handle
                self.status.value = "Started; running in the background."
                return handle
            try:
                self.result = handle.result()
            except KeyboardInterrupt:  # the interrupt button: stop every worker, then raise
                handle.stop()
                raise
        except BaseException as err:
            self.status.value = (
                f"<span style='color:#c62828'>Failed: {html.escape(type(err).__name__)}</span>"
            )
            raise
        finally:
            self._refresh()
        self.status.value = "Finished."
        return self.result

    def _on_launch_click(self) -> None:
        try:
            self.launch()
        except Exception as err:  # show it; an exception in a callback is lost in the browser
            self.sink.write("".join(traceback.format_exception_only(type(err), err)))

    def _on_save_click(self) -> None:
        try:
            self.save()
        except (ConfigError, OSError) as err:
            self.status.value = f"<span style='color:#c62828'>{html.escape(str(err))}</span>"

    def __repr__(self) -> str:
        return f"LaunchPanel({_function_name(self.training_function)}, {self._values()})"


def _function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


__all__ = ["LaunchPanel"]
