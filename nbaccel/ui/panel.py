"""``LaunchPanel``: configure and launch a training function from an ipywidgets panel.

The controls are derived from :class:`nbaccel.config.LaunchConfig` (its fields,
``Literal`` choices, minimums and docstring), the starting values from
:func:`nbaccel.config.resolve_launch_config` (environment and config file), so the
panel, the YAML file and the ``nbaccel`` command always agree.

Launch runs in the background by default (the "in the background" box): the kernel
is free at once and the live monitor under the buttons follows the run (charts of the
logged values, stragglers, each rank's stack on request). A setting that works but
costs speed -- more processes than the cores (or TPU cores) seen here -- is pointed
out next to its field without blocking Launch; an impossible one blocks it.

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
import importlib.util
import re
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets

from ..config import (
    CallOptions,
    LaunchConfig,
    default_config_path,
    field_names,
    resolve_launch_config,
    save_config,
)
from ..config.store import with_host_defaults
from ..errors import ConfigError, Stopped
from ..launch.engine._tidy import oversubscribed
from ..platform.hardware import (
    Hardware,
    default_num_processes,
    detect_hardware,
    hardware_precision_problem,
    notebook_host,
)
from ._panel_parts import OutputSink, field_value, make_control
from .monitor import RunMonitor

_MULTI_NODE = ("node_rank", "master_addr", "master_port")
_CALL_OPTIONS = set(CallOptions.__dataclass_fields__) - {"block"}  # a pool call's options


class LaunchPanel(widgets.VBox):
    """A panel with a control per launch setting, Launch and Save-as-default buttons.

    Args:
        training_function: the function every process runs (as for ``notebook_launcher``).
        args: positional arguments for it.
        config: starting values (default: arguments > NBACCEL_* env > config file).
        launcher_kwargs: extra keyword arguments for ``notebook_launcher`` (e.g. ``output``,
            ``return_all_ranks``); the seam the live view plugs into.
        pool: a warm :class:`~nbaccel.WorkerPool`: Launch runs the function on its
            workers (``pool.call``) instead of starting new ones; the pool's own settings
            apply, the controls are not used for the run.

    Attributes:
        controls: ``{field: widget}`` for every LaunchConfig field.
        messages: ``{field: HTML}`` where a field's problem (red) or advice (orange) is shown.
        background: the "in the background" checkbox the Launch button follows.
        handle: the last launch's ``LaunchHandle`` (None before the first).
        result: the last run's value (after a background run: once it ended).
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
        self.handle: Any = None  # the last launch's LaunchHandle
        self._running = False  # a background launch from the button is going on
        note = ""
        if config is None:
            try:
                config = resolve_launch_config()
            except ConfigError as err:  # a broken file must not hide the panel
                config, note = LaunchConfig(), f"Ignoring the saved config: {err}"
        # Colab's TPU v5e-1: 1 process; Kaggle's v5e-8: 8; Kaggle's 2 x T4: 2 and fp16.
        self.host = notebook_host()
        config = with_host_defaults(config, self.host, self.hardware.kind)
        if config.num_processes is None:  # CPU only: one process per core, up to 8
            fits = default_num_processes(config.compute_device, config.gpu_ids)
            cpu = config.compute_device == "cpu" or self.hardware.kind == "cpu"
            config = config.replace(num_processes=min(self.hardware.cpu_count, 8) if cpu else fits)
        self.controls: dict[str, widgets.ValueWidget] = {}
        self.messages: dict[str, widgets.HTML] = {}
        self.rows: dict[str, widgets.HBox] = {}
        for name in field_names():
            self.controls[name] = make_control(name, getattr(config, name), hardware=self.hardware)
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
        self.stop_button = widgets.Button(  # the kernel's stop button stops a background
            description="Stop",  # run only while no cell runs: this one always does
            icon="stop",
            tooltip="stop the background run (handle.stop())",
            layout=widgets.Layout(display="none"),
        )
        self.stop_button.on_click(lambda _button: self.stop())
        self.background = widgets.Checkbox(
            value=True,
            description="in the background",
            indent=False,  # no tooltip: a Checkbox has none in ipywidgets 7.7 (Colab)
            layout=widgets.Layout(width="auto"),
        )
        self.status = widgets.HTML(html.escape(note))
        self.output = widgets.Output(
            layout=widgets.Layout(border="1px solid #ddd", min_height="2em", padding="4px")
        )
        # a tqdm bar shows once: in the monitor's bar once it draws it, not also as text here
        self.sink = OutputSink(self.output, hide_bars=lambda: self.monitor.draws_progress)
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
                widgets.HBox(self._buttons()),
                self.monitor.widget,
                self.output,
            ]
        )
        self.add_class("nbaccel-launch-panel")
        self._refresh()

    # ------------------------------------------------------------------ building
    # ------------------------------------------------------------------ state
    def _values(self) -> dict[str, Any]:
        values = {name: field_value(name, control.value) for name, control in self.controls.items()}
        # one machine, or a cluster placing the ranks: the launcher picks a free port
        if values["num_nodes"] == 1 or values.get("cluster"):
            values["node_rank"], values["master_port"] = 0, None
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
        precision = hardware_precision_problem(
            self.hardware, cfg.mixed_precision, cfg.compute_device
        )
        if precision:
            found["mixed_precision"] = precision
        if cfg.strategy == "fsdp" and (cfg.num_processes or 1) * cfg.num_nodes < 2:
            found["strategy"] = "fsdp shards across processes: use 2 or more processes."
        if cfg.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            found["strategy"] = (
                "deepspeed is not installed: pip install --no-build-isolation deepspeed"
            )
        return found

    def warnings(self) -> dict[str, str]:
        """``{field: advice}`` for settings that work but cost speed (shown, not blocking)."""
        try:
            cfg = self.config
        except ConfigError:
            return {}
        processes, hw = cfg.num_processes or 1, self.hardware
        on_cpu = cfg.compute_device == "cpu" or (cfg.compute_device == "auto" and hw.kind == "cpu")
        advice = oversubscribed(processes, hw.cpu_count) if on_cpu else None
        if advice is not None:  # the text notebook_launcher warns with
            return {"num_processes": advice}
        on_tpu = cfg.compute_device == "tpu" or (cfg.compute_device == "auto" and hw.kind == "tpu")
        if on_tpu and processes > hw.device_count:
            return {
                "num_processes": f"{processes} processes for {hw.device_count} TPU core(s) "
                f"seen here: use at most {hw.device_count}."
            }
        return {}

    def _refresh(self) -> None:
        nodes = self.controls["num_nodes"].value
        rank = self.controls["node_rank"]
        rank.max = max(nodes - 1, 0)  # clamps the value too
        placed = bool(str(self.controls["cluster"].value).strip())  # the cluster meets itself
        for name in _MULTI_NODE:
            self.rows[name].layout.display = None if nodes > 1 and not placed else "none"
        self.rows["cpus_per_rank"].layout.display = None if placed else "none"  # a cluster's
        uses_gpu = self.controls["compute_device"].value == "gpu" or (
            self.controls["compute_device"].value == "auto" and self.hardware.kind == "gpu"
        )
        self.rows["gpu_ids"].layout.display = None if uses_gpu else "none"
        chosen = self.controls["strategy"].value + "_"  # a strategy's options only when chosen
        for name in self.rows:
            if name.startswith(("fsdp_", "deepspeed_")):
                self.rows[name].layout.display = None if name.startswith(chosen) else "none"
        found, advice = self.problems(), self.warnings()
        for name, message in self.messages.items():
            text, color = (
                (found[name], "#c62828") if name in found else (advice.get(name), "#e65100")
            )
            message.value = (
                f"<span style='color:{color}'>{html.escape(text)}</span>" if text else ""
            )
        self.launch_button.disabled = bool(found) or self._running
        self.stop_button.layout.display = None if self._running else "none"
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
                    own = {k: v for k, v in options.items() if k in _CALL_OPTIONS}
                    handle = self.pool.call(self.training_function, self.args, block=False, **own)
                else:
                    handle = launcher.notebook_launcher(
                        self.training_function, self.args, config=cfg, block=False, **options
                    )
            self.monitor.attach(handle)
            self.handle = handle
            if not block:
                self.result = handle
                self.status.value = "Started; running in the background (the kernel is free)."
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
        self.status.value = _finished(self.result)
        return self.result

    def _on_launch_click(self) -> None:
        try:
            if not self.background.value:
                self.launch()
                return
            handle = self.launch(block=False)  # the kernel is free again at once
        except Exception as err:  # show it; an exception in a callback is lost in the browser
            self.sink.write("".join(traceback.format_exception_only(type(err), err)))
            return
        self._running = True
        self._refresh()  # Launch stays disabled until the run ends
        waiter = threading.Thread(
            target=self._await, args=(handle,), name="nbaccel-panel-run", daemon=True
        )
        waiter.start()

    def _await(self, handle: Any) -> None:
        """A background run from the button: its outcome in the status, its error in the output."""
        try:
            self.result = handle.result()
            self.status.value = _finished(self.result)
        except Stopped:  # the Stop button (or handle.stop()): not a failure
            self.status.value = "Stopped."
        except BaseException as err:
            self.status.value = (
                f"<span style='color:#c62828'>Failed: {html.escape(type(err).__name__)}</span>"
            )
            self.sink.write("".join(traceback.format_exception_only(type(err), err)))
        finally:
            self._running = False
            self._refresh()

    def _buttons(self) -> list[Any]:
        return [self.launch_button, self.stop_button, self.background, self.save_button,
                self.status]  # fmt: skip

    def stop(self) -> None:
        """What the Stop button does: stop the background run (``handle.stop()``)."""
        if self.handle is not None:
            self.handle.stop(timeout=0)  # the run's thread ends it; the kernel stays free
            self.status.value = "Stopping&hellip;"

    def _on_save_click(self) -> None:
        try:
            self.save()
        except (ConfigError, OSError) as err:
            self.status.value = f"<span style='color:#c62828'>{html.escape(str(err))}</span>"

    def __repr__(self) -> str:
        return f"LaunchPanel({_function_name(self.training_function)}, {self._values()})"


def _finished(value: Any) -> str:
    """The status after a run: what the function returned (as ``panel.result`` holds it)."""
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:199] + "\u2026"
    return f"Finished; returned <code>{html.escape(shown)}</code> (<code>panel.result</code>)."


def _function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


__all__ = ["LaunchPanel"]
