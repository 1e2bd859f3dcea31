"""Pass base class, pipeline text (parse/print) and the pass manager."""
from __future__ import annotations

import dataclasses
import functools
import gc
import time
import typing
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ModelError, PassFailure, PipelineError, PreconditionError, QpassesError
from ..executors.threads import serial_blas
from ..ir.model import QModel, constant_bytes, relaxed_gc
from .context import RunContext
from .facts import CLAIMS
from .registry import all_passes, establishers, get_pass


@dataclass
class PassResult:
    model: QModel
    modified: bool
    stats: dict = field(default_factory=dict)


class Pass:
    """Base of every pass. Subclasses set ``name``, a docstring, facts, and options as fields.

    Facts have a safe default: a pass that reports a modification keeps only the facts it declares
    it ``preserves`` and the claims (facts.CLAIMS) it does not declare it ``invalidates``, and adds
    those it ``establishes``. Analyses too (qpasses.ir.analyses): it keeps only those reading parts
    of the model it declares ``unchanged`` (e.g. GRAPH and WEIGHTS for a pass that edits the table),
    and any analysis it names there."""

    name: ClassVar[str] = ""
    requires: ClassVar[frozenset] = frozenset()
    establishes: ClassVar[frozenset] = frozenset()
    preserves: ClassVar[frozenset] = frozenset()
    invalidates: ClassVar[frozenset] = frozenset()   # claims (facts.CLAIMS) its rewrite undoes
    unchanged: ClassVar[frozenset] = frozenset()     # ir.analyses.Part it never changes, or analyses

    def __post_init__(self):
        for f in self.options():   # a nested pipeline given as text (Python callers)
            if isinstance(getattr(self, f.name), str) and _option_type(type(self), f) is Pipeline:
                setattr(self, f.name, _parse_value(type(self), f, getattr(self, f.name)))

    def run(self, model: QModel, ctx: RunContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0]

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    def given_options(self) -> dict[str, str]:
        """Options as text: those given explicitly (in the order given), then any other non-default."""
        explicit = getattr(self, "_explicit", ())
        out = {name: format_value(getattr(self, name)) for name in explicit}
        for f in self.options():
            value = getattr(self, f.name)
            if f.name not in out and value != option_default(f):
                out[f.name] = format_value(value)
        return out

    def text(self) -> str:
        opts = self.given_options()
        return self.name + ("{" + ",".join(f"{k}={v}" for k, v in opts.items()) + "}" if opts else "")


def option_default(f: dataclasses.Field):
    """An option's default value (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def format_value(value) -> str:
    """An option value as pipeline text writes it (quoted when it holds , { } = or quotes; a
    nested Pipeline as its text)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value).removesuffix(".0") if value.is_integer() else repr(value)
    text = str(value)
    if text and not any(c in _SPECIAL for c in text) and text == text.strip():
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_SPECIAL = frozenset(',{}="\'\\')


def _option_type(cls, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args and typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) else hint


def _parse_value(cls, f: dataclasses.Field, text: str):
    kind = _option_type(cls, f)
    choices = f.metadata.get("choices")
    where = f"option '{f.name}' of pass '{cls.name}'"
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            value = text.lower() in ("true", "1", "yes")
        elif kind is int:
            value = int(text)
        elif kind is float:
            value = float(text)
        elif kind is Pipeline:
            value = Pipeline.parse(text)
        else:
            value = text
    except ValueError:
        raise PipelineError(f"{where}: '{text}' is not a valid {getattr(kind, '__name__', kind)}") from None
    except PipelineError as exc:   # a nested pipeline's
        raise PipelineError(f"{where}: {exc}") from None
    if choices and value not in choices:
        raise PipelineError(f"{where}: '{text}' is not one of {', '.join(map(str, choices))}")
    return _within_bounds(cls, f, value)


def _within_bounds(cls, f: dataclasses.Field, value):
    """``value``, refused unless above the option's ``above`` (metadata), when it has one."""
    above = f.metadata.get("above")
    if above is not None and isinstance(value, (int, float)) and not value > above:
        raise PipelineError(f"option '{f.name}' of pass '{cls.name}': {value} is not above {above}")
    return value


def make_pass(name: str, **options) -> Pass:
    """Instantiate a registered pass with options given as Python values or text."""
    cls = get_pass(name)
    fields = {f.name: f for f in cls.options()}
    kwargs = {}
    for key, value in options.items():
        if key not in fields:
            import difflib

            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            valid = ", ".join(fields) or "none"
            raise PipelineError(f"pass '{name}' has no option '{key}'{hint}; options: {valid}")
        kwargs[key] = (_parse_value(cls, fields[key], value) if isinstance(value, str)
                       else _within_bounds(cls, fields[key], value))
    instance = cls(**kwargs)
    instance._explicit = tuple(kwargs)
    return instance


def parse_pipeline(text: str) -> list[Pass]:
    """Parse ``pass,pass{opt=value,opt="quoted, value"},...`` into pass instances.

    A value is bare text up to ``,`` or ``}``, or quoted with ``"`` or ``'`` (backslash escapes the
    quote and itself); a nested pipeline (select-by-snr's ``then``) is a quoted value."""
    return [make_pass(name, **options) for name, options in _Reader(text).pipeline()]


class _Reader:
    """A tiny recursive-descent reader of pipeline text."""

    def __init__(self, text: str):
        self.text, self.i = text, 0

    def pipeline(self) -> list[tuple[str, dict]]:
        if not self.text.strip():
            raise PipelineError("empty pipeline text")
        items = [self.item()]
        while self.peek() == ",":
            self.i += 1
            items.append(self.item())
        if self.peek():
            raise PipelineError(f"pipeline text: expected ',' after '{items[-1][0]}' at column {self.i + 1}")
        return items

    def peek(self) -> str:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1
        return self.text[self.i] if self.i < len(self.text) else ""

    def item(self) -> tuple[str, dict]:
        name = self.bare(",{}").strip()
        if not name:
            raise PipelineError(f"pipeline text: missing pass name at column {self.i + 1}")
        options: dict[str, str] = {}
        if self.peek() == "{":
            self.i += 1
            while self.peek() != "}":
                if not self.peek():
                    raise PipelineError(f"pipeline text: unclosed '{{' after '{name}'")
                key = self.bare(",}=").strip()
                if self.peek() != "=":
                    if not key:   # an empty item: 'pass{a=1,}'
                        self.i += self.peek() == ","
                        continue
                    raise PipelineError(f"pipeline text: option '{key}' of '{name}' needs key=value")
                self.i += 1
                options[key] = self.value()
                if self.peek() == ",":
                    self.i += 1
            self.i += 1
        return name, options

    def bare(self, stops: str) -> str:
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in stops:
            if self.text[self.i] in "\"'":
                raise PipelineError(f"pipeline text: unexpected quote at column {self.i + 1}")
            self.i += 1
        return self.text[start:self.i]

    def value(self) -> str:
        quote = self.peek()
        if quote not in ("\"", "'"):
            return self.bare(",}").strip()
        out, self.i = [], self.i + 1
        while self.i < len(self.text) and self.text[self.i] != quote:
            if self.text[self.i] == "\\" and self.i + 1 < len(self.text):
                self.i += 1
            out.append(self.text[self.i])
            self.i += 1
        if self.i >= len(self.text):
            raise PipelineError(f"pipeline text: unclosed {quote} in an option value")
        self.i += 1
        return "".join(out)


def print_pipeline(passes) -> str:
    return ",".join(p.text() for p in passes)


class Pipeline:
    """Passes in order: what a pass option holding a nested pipeline holds (select-by-snr's
    ``then``). Parsed from pipeline text (``Pipeline.parse``), printed back as text (``str``): the
    option's text in --passes, configs and passes.md is the pipeline text, quoted."""

    def __init__(self, passes=()):
        self.passes = tuple(passes)

    @classmethod
    def parse(cls, text: str) -> "Pipeline":
        return cls(parse_pipeline(text))

    def __str__(self) -> str:
        return print_pipeline(self.passes)

    def __repr__(self) -> str:
        return f"Pipeline({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Pipeline) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __iter__(self):
        return iter(self.passes)

    def __len__(self) -> int:
        return len(self.passes)

    def __add__(self, other) -> "Pipeline":
        return Pipeline((*self.passes, *other))

    def split_after(self, name: str) -> tuple["Pipeline", "Pipeline"]:
        """The passes up to the first pass ``name`` (included) and the rest; all of them in the
        second part when ``name`` is absent. A pass can act between the two."""
        cut = next((i + 1 for i, p in enumerate(self.passes) if p.name == name), 0)
        return Pipeline(self.passes[:cut]), Pipeline(self.passes[cut:])

    def run(self, model: QModel, ctx: RunContext) -> list[PassRecord]:
        """Run nested in a pass (on a copy it made): with the run's instruments, ``ctx.nested()``."""
        return PassManager(self.passes).run(model, ctx.nested()) if self.passes else []


def pipeline_option(default: str, help: str):
    """A pass option holding a nested ``Pipeline``, ``default`` its pipeline text."""
    return field(default_factory=functools.partial(Pipeline.parse, default), metadata={"help": help})


BASE_PIPELINE = "fold-constants,fold-batchnorm,cleanup"
QUANTIZE_PIPELINE = (BASE_PIPELINE + ",smooth-quant,annotate-types,propagate-mixed-precision,calibrate,"
                     "select-by-snr,search-precision,quantize-silu,compute-qparams,protect-pair-sums,round-weights,"
                     "correct-bias,fix-bias-scales,insert-qdq,insert-converts,quantize-gathers,cleanup")
# effort: high reconstructs the weights against the quantized model's own inputs where the default
# rounds them against the float model's (docs/decisions/weights.md)
HIGH_EFFORT = {"round-weights": "reconstruct-weights"}


WEIGHT_ONLY_PIPELINE = BASE_PIPELINE + ",quantize-weights,quantize-gathers,cleanup"
# config ``mode`` -> its default pipeline, with or without data (``static``: QUANTIZE_PIPELINE with data)
MODE_PIPELINES = {"weight_only": WEIGHT_ONLY_PIPELINE, "dynamic": BASE_PIPELINE + ",quantize-dynamic,quantize-gathers,cleanup"}


def default_pipeline(quantize: bool, mode: str = "static", format: str = "qdq", effort: str = "default") -> str:
    """The pipeline `qpasses run` uses without --passes: the ``mode``'s (config), else quantize
    when calibration data is given; ``effort: high`` reconstructs the weights against the quantized
    model's own inputs (reconstruct-weights instead of round-weights); ``format: qoperator`` appends
    lower-qoperator."""
    if mode in MODE_PIPELINES:
        return MODE_PIPELINES[mode]
    if not quantize:
        return BASE_PIPELINE
    passes = QUANTIZE_PIPELINE
    if effort == "high":
        passes = ",".join(HIGH_EFFORT.get(p, p) for p in passes.split(","))
    return passes + ",lower-qoperator,cleanup" if format == "qoperator" else passes


COLLECT_BYTES = 64 * 2**20  # models with this many bytes of weights are garbage-collected after each pass


@dataclass
class PassRecord:
    name: str
    text: str
    modified: bool
    seconds: float
    stats: dict


class PassManager:
    """Runs passes in order: checks required facts, applies the facts' safe default, and runs the
    instruments around each pass (those of ``ctx`` too, so pipelines nested in a pass are seen)."""

    def __init__(self, passes, instruments=()):
        self.passes = parse_pipeline(passes) if isinstance(passes, str) else list(passes)
        self.instruments = list(instruments)

    @property
    def text(self) -> str:
        return print_pipeline(self.passes)

    def run(self, model: QModel, ctx: RunContext | None = None) -> list[PassRecord]:
        ctx = ctx if ctx is not None else RunContext()
        if ctx.depth:
            return self._run(model, ctx)
        with serial_blas():   # numpy's products in passes are small: a second BLAS thread only waits on busy cores
            return self._run(model, ctx)

    @relaxed_gc()
    def _run(self, model: QModel, ctx: RunContext) -> list[PassRecord]:
        if ctx.depth == 0:   # kept on the context: pipelines nested in a pass run them too
            ctx.instruments = self.instruments
        instruments = ctx.instruments
        records: list[PassRecord] = []
        # gs tensors and nodes sit in reference cycles (with their own input/output lists): the
        # weights a pass replaces are freed only by a full collection. Models with big weights
        # (few nodes: it is cheap) get one after each pass that changed them.
        collect = constant_bytes(model.graph) >= COLLECT_BYTES
        for index, p in enumerate(self.passes):
            self._check_requires(p, model, records)
            for inst in instruments:
                inst.before(index, p, model, ctx)
            start = time.perf_counter()
            try:
                result = p.run(model, ctx)
            except QpassesError:
                self._failed(instruments, index, p, model, ctx)
                raise
            except Exception as exc:
                self._failed(instruments, index, p, model, ctx)
                ran = ", ".join(r.name for r in records) or "none"
                raise PassFailure(f"pass '{p.name}' failed: {type(exc).__name__}: {exc} "
                                  f"(passes run before it: {ran})") from exc
            seconds = time.perf_counter() - start
            model = result.model
            if result.modified:
                model.analyses.invalidate(p.unchanged)
                model.facts &= set(p.preserves) | (CLAIMS - p.invalidates)
            model.facts |= set(p.establishes)
            if collect and result.modified:
                gc.collect()
            record = PassRecord(p.name, p.text(), result.modified, seconds, dict(result.stats))
            records.append(record)
            for inst in instruments:
                inst.after(index, p, model, record, ctx)
        if ctx.depth == 0:
            check_claims(model, records)
        return records

    def _check_requires(self, p: Pass, model: QModel, records) -> None:
        for fact in sorted(p.requires - model.facts):
            by = establishers(fact)
            hint = f"run {' or '.join(repr(n) for n in by)} before it" if by else "no pass establishes it"
            dropped = next((r.name for r in reversed(records) if r.modified), None)
            why = f" (it was dropped by '{dropped}', which changed the model)" if dropped and any(
                fact in get_pass(r.name).establishes for r in records) else ""
            raise PreconditionError(f"pass '{p.name}' requires fact '{fact}'{why}: {hint}")

    def _failed(self, instruments, index, p, model, ctx) -> None:
        for inst in instruments:
            inst.failed(index, p, model, self.passes[index:], ctx)


def check_claims(model: QModel, records: list[PassRecord]) -> None:
    """The end of a run: every fact the model carries holds. A broken one is an internal error of
    the last pass that established it or changed the model keeping it; ModelError when it came with
    the input model untouched."""
    from .facts import fact_problems

    failed = fact_problems(model)
    if failed is None:
        return
    fact, text = failed
    for r in reversed(records):
        cls = get_pass(r.name)
        if fact in cls.establishes or (r.modified and fact in cls.preserves):
            raise PassFailure(f"pass '{r.name}' reported what the graph does not hold: {text}")
    raise ModelError(f"the model's saved decisions do not match its graph: {text}")


def in_pipeline_order() -> list[type]:
    """Every registered pass: those of the default quantize pipeline in its order, then the rest by name."""
    passes = all_passes()
    names = [part.split("{")[0].strip() for part in default_pipeline(True).split(",")]
    first = [name for name in dict.fromkeys(names) if name in passes]
    return [passes[name] for name in first + sorted(set(passes) - set(first))]
