"""`DiLoCo`: the method as one value, built from parts that check themselves.

A spec is frozen and hashable, like an optax transformation: build it once, pass it to
`init_state`, `diloco_round` and `train_diloco`. Each part validates its own fields when it is
built and owns its rules with the other parts (`check_with`, called once here):

- inner, outer: optax transformations (None: the paper's AdamW and Nesterov). EDiT's clip is
  `optax.chain(clip_outer_norm(phi), outer)`; outer-momentum restarts `restart_momentum(outer,
  every=K)`: outer rules are transformations, not fields;
- schedule: None (standard DiLoCo) or `Streaming` (`diloco_jax.schedule`);
- compression: a `Compression` (a string spec parses into it; `diloco_jax.compression`);
- weights: `Weights` (`diloco_jax.faults`): exclusion, drops, per-worker steps, weighting,
  anomaly skip;
- delay: None, `Delayed(d)` or `Eager(d)` (`diloco_jax.delay`);
- state_sync: None or `StateSync(mu=K_u, nu=K_v)` (`diloco_jax.state_sync`);
- gossip: None, `NoLoCo` (`diloco_jax.noloco`) or `GASLoC` (`diloco_jax.gasloc`): each
  worker averages with a random group, not all M.

What needs the params, M or H (fragments against the leaves, H a multiple of P, worker steps
per worker, state-sync fields of the inner state) is checked by `check_run` when a round is
built. `method_from_options` turns the keyword shorthand of `train_diloco` and friends into a
spec: `train_diloco(..., fragments=2)` is `method=DiLoCo(schedule=Streaming(2))`.
"""

import dataclasses
from typing import Any

import jax
import optax

from diloco_jax.carry import Part
from diloco_jax.comm import round_wire_bytes
from diloco_jax.compression import Compression, parse_compression
from diloco_jax.delay import Delayed, Eager
from diloco_jax.faults import NormSoftmax, Weights
from diloco_jax.gasloc import GASLoC
from diloco_jax.heloco_outer import job_start
from diloco_jax.noloco import NoLoCo
from diloco_jax.outer import cast_state, checked_state_dtype, clip_outer_norm
from diloco_jax.schedule import Schedule, Streaming, fragment_of, make_schedule
from diloco_jax.state_sync import StateSync


def default_inner_optimizer() -> optax.GradientTransformation:
    """The paper's inner optimizer: AdamW(lr 4e-4, b1 0.9, b2 0.95, weight decay 0.1)."""
    return optax.adamw(4e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def default_outer_optimizer() -> optax.GradientTransformation:
    """The paper's outer optimizer: SGD with Nesterov momentum (lr 0.7, momentum 0.9)."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """A DiLoCo method (see the module docstring); every field at its default is the paper's
    DiLoCo. `weights.exclude_nonfinite=None` resolves here: on for the exact exchange without
    eager updates, off otherwise."""

    inner: optax.GradientTransformation | None = None
    outer: optax.GradientTransformation | None = None
    schedule: Streaming | None = None
    compression: "Compression | str | None" = None
    weights: Weights = Weights()
    delay: Delayed | None = None
    state_sync: StateSync | None = None
    gossip: NoLoCo | GASLoC | None = None
    # The outer state's dtype (e.g. "bfloat16": half the momentum's bytes, lossy); None keeps
    # `delta_dtype` (float32 or wider). Deltas are averaged in float32 either way.
    outer_state_dtype: str | None = None

    def __post_init__(self):
        for name in ("inner", "outer"):
            opt = getattr(self, name)
            if opt is not None and not (
                callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))
            ):
                raise ValueError(
                    f"DiLoCo.{name} ({name}_optimizer) must be an optax GradientTransformation, "
                    f"got {opt!r}"
                )
        for name, kind in (
            ("schedule", Streaming),
            ("weights", Weights),
            ("delay", Delayed),
            ("state_sync", StateSync),
            ("gossip", (NoLoCo, GASLoC)),
        ):
            value = getattr(self, name)
            if not (isinstance(value, kind) or (value is None and name != "weights")):
                kinds = " or ".join(
                    k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))
                )
                raise ValueError(f"DiLoCo.{name} must be a {kinds}, got {value!r}")
        object.__setattr__(self, "compression", parse_compression(self.compression))
        if self.outer_state_dtype is not None:  # a name: hashable, and a stable repr
            name = checked_state_dtype(self.outer_state_dtype).name
            object.__setattr__(self, "outer_state_dtype", name)
        if self.weights.exclude_nonfinite is None:
            auto = self._default_weights().exclude_nonfinite
            object.__setattr__(
                self, "weights", dataclasses.replace(self.weights, exclude_nonfinite=auto)
            )
        # Each part owns its rules with the others (`check_with`), checked once, here.
        for part in self.parts:
            part.check_with(self)

    def __repr__(self) -> str:
        """The parts that differ from DiLoCo's defaults; optimizers as `<optax>` (they have
        no stable text), so the repr is stable across processes (checkpoints, run.json)."""
        defaults = _DEFAULTS | {"weights": self._default_weights()}
        shown = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == defaults[field.name]:
                continue
            text = "<optax>" if field.name in ("inner", "outer") else repr(value)
            shown.append(f"{field.name}={text}")
        return f"DiLoCo({', '.join(shown)})"

    def _default_weights(self) -> Weights:
        """Weights() as resolved for this spec's compression and delay."""
        exact = self.compression.kind == "none" and not self.owns_theta
        return Weights(exclude_nonfinite=exact)

    @property
    def parts(self) -> tuple[Part, ...]:
        """The spec's parts that are set, in field order (each owns its rules, its state and
        its roles in a round: `carry.Part`)."""
        values = (getattr(self, field.name) for field in dataclasses.fields(self))
        return tuple(v for v in values if isinstance(v, Part))

    @property
    def inner_optimizer(self) -> optax.GradientTransformation:
        return default_inner_optimizer() if self.inner is None else self.inner

    @property
    def outer_optimizer(self) -> optax.GradientTransformation:
        """The outer rule: `outer`, or the paper's Nesterov (with `gossip`, its part's
        default: NoLoCo's heavy-ball, GASLoC's SGD); its state cast to `outer_state_dtype`
        when that is set."""
        outer = self.outer
        if outer is None:
            outer = (
                default_outer_optimizer() if self.gossip is None else self.gossip.default_outer()
            )
        if self.outer_state_dtype is not None:
            return cast_state(outer, self.outer_state_dtype)
        return outer

    @property
    def outer_delay(self) -> int:
        """d, the rounds a mean waits (0 without a delay)."""
        return 0 if self.delay is None else self.delay.rounds

    @property
    def eager(self) -> bool:
        return self.delay is not None and self.delay.eager

    @property
    def owns_theta(self) -> bool:
        """Whether each worker holds its own θ and outer state (eager updates, NoLoCo): no
        global θ in the state."""
        return self.eager or self.gossip is not None

    @property
    def fragmented(self) -> bool:
        return self.schedule is not None

    def check_run(
        self,
        params: Any,
        num_workers: int,
        inner_steps: int,
        frozen: tuple = (),
        inner_state: Any = None,
    ) -> Schedule:
        """The round's schedule for `params` (arrays or shapes), M workers and H inner steps,
        each part checked against them (`inner_state`: one worker's inner state or its
        shapes, when it is not the inner optimizer's, e.g. a worker step's); ValueError naming
        the part's field that can't run with them."""
        schedule = make_schedule(params, inner_steps, self.schedule, frozen)
        if inner_state is None:
            inner_state = jax.eval_shape(self.inner_optimizer.init, params)
        for part in self.parts:
            part.check_run(params, num_workers, inner_steps, inner_state)
        return schedule

    def num_syncs(self, params: Any) -> int:
        """Syncs per round: 1, or P with Streaming DiLoCo's fragments."""
        return (
            1 if self.schedule is None else max(fragment_of(params, self.schedule.assignment)) + 1
        )

    def fingerprint(self) -> dict[str, Any]:
        """The spec's checkpoint identity (JSON-able), in the fields checkpoints have carried
        since before the spec existed, so older checkpoints of the same method restore. The
        optimizers have no stable form and are not part of it."""
        # Standard DiLoCo's schedule, as Streaming's fields (no fragments, tau 0, alpha 0).
        out = {"fragments": repr((None, 0, 0.0))}
        variant = {}
        for part in self.parts:
            out |= part.fingerprint()
            variant |= part.variant()
        if variant:
            out["variant"] = [repr(variant), None]
        if self.outer_state_dtype is not None:
            out["outer_state_dtype"] = self.outer_state_dtype
        return out

    def round_wire_bytes(
        self, params: Any, num_workers: int, frozen: tuple = (), specs: tuple | None = None
    ) -> float:
        """Bytes each worker sends on the wire per round, summed over the parts: the
        schedule's syncs (`frozen` leaves in none), each with the exchange's and the weights'
        bytes, and the loss metric (`comm.round_wire_bytes`; `specs` for one device's shards
        on a mesh). DES-LOC's state syncs run on their own step schedule:
        `state_sync.transfers`."""
        return round_wire_bytes(
            params,
            self.compression,
            num_workers,
            fragments=None if self.schedule is None else self.schedule.assignment,
            weighted=self.weights.active,
            softmax=self.weights.scheme == "norm_softmax",
            frozen=frozen,
            specs=specs,
            gossip=self.gossip,
        )


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DiLoCo)}
_DEFAULTS["compression"] = parse_compression(None)

# The keyword shorthand: each keyword and the part it builds.
SHORTHAND = (
    "inner_optimizer",
    "outer_optimizer",
    "outer_clip",
    "compression",
    "exclude_nonfinite",
    "drop_probability",
    "drop_seed",
    "worker_steps",
    "weighting",
    "temperature",
    "anomaly",
    "membership",
    "fragments",
    "overlap_steps",
    "merge_alpha",
    "outer_delay",
    "eager",
    "state_sync",
    "gossip_group_size",
    "gasloc",
    "outer_state_dtype",
)


# Where an outer rule's look-ahead start (HeLoCo's θ̄) is honoured: train_async (and the
# async elastic syncer, whose task is checked by ElasticTask), and the LM app's config, whose
# --algo async check comes with the command line.
LOOKAHEAD_CALLERS = ("train_async", "RunConfig")


def method_from_options(
    method: "DiLoCo | None", options: dict[str, Any], *, caller: str, allowed=SHORTHAND
) -> DiLoCo:
    """The one spec a call describes: `method`, or the keyword shorthand `options` built into
    a `DiLoCo` (never both). `caller` names the function in errors; `allowed` are the
    keywords it takes (e.g. `train_async`: the optimizers only). An outer rule with a
    look-ahead start (HeLoCo's) is refused outside LOOKAHEAD_CALLERS: a round would start
    every worker from θ, not from its θ̄."""
    spec = _method_from_options(method, options, caller=caller, allowed=allowed)
    if caller not in LOOKAHEAD_CALLERS and job_start(spec.outer) is not None:
        raise ValueError(
            f"{caller}: the outer rule starts jobs from a look-ahead θ̄ (HeLoCo), which "
            "train_async and the async elastic syncer do; here every worker starts from θ: "
            "use train_async, or heloco(..., lookahead=False)"
        )
    return spec


def _method_from_options(
    method: "DiLoCo | None", options: dict[str, Any], *, caller: str, allowed=SHORTHAND
) -> DiLoCo:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword arguments {unknown}")
    if method is not None:
        if options:
            raise ValueError(
                f"{caller}: give either method= or the keyword shorthand, not both "
                f"(got method and {sorted(options)})"
            )
        if not isinstance(method, DiLoCo):
            raise ValueError(f"{caller}: method must be a diloco_jax.DiLoCo, got {method!r}")
        return method
    o = dict(options)
    outer = o.pop("outer_optimizer", None)
    clip = o.pop("outer_clip", None)
    if clip is not None:
        outer = optax.chain(
            clip_outer_norm(clip), default_outer_optimizer() if outer is None else outer
        )
    weighting = o.pop("weighting", "uniform")
    temperature = o.pop("temperature", None)
    if temperature is not None:
        if weighting != "norm_softmax":
            raise ValueError(
                "temperature applies to weighting='norm_softmax' only (it is "
                f"NormSoftmax.temperature), got weighting={weighting!r}"
            )
        weighting = NormSoftmax(temperature)
    fragments = o.pop("fragments", None)
    overlap, alpha = o.pop("overlap_steps", 0), o.pop("merge_alpha", 0.0)
    if fragments is None and (overlap or alpha):
        raise ValueError(
            "overlap_steps and merge_alpha need fragments (they are Streaming.overlap_steps "
            f"and Streaming.merge_alpha), got overlap_steps={overlap!r}, merge_alpha={alpha!r}"
        )
    d, eager = o.pop("outer_delay", 0), o.pop("eager", False)
    if not isinstance(eager, bool):
        raise ValueError(f"eager must be a bool, got {eager!r}")
    delay = None
    if d != 0 or eager:
        delay = (Eager if eager else Delayed)(d)
    state_sync = o.pop("state_sync", None)
    group_size = o.pop("gossip_group_size", None)
    gasloc = o.pop("gasloc", None)
    gossip = None
    if gasloc is not None:  # GASLoC's alpha / gamma / seed, in groups of group_size (2)
        if not isinstance(gasloc, dict):
            raise ValueError(f"gasloc must be a dict of GASLoC's fields, got {gasloc!r}")
        gossip = GASLoC(2 if group_size is None else group_size, **gasloc)
    elif group_size is not None:
        gossip = NoLoCo(group_size)
    weights = Weights(
        exclude_nonfinite=o.pop("exclude_nonfinite", None),
        drop_probability=o.pop("drop_probability", None),
        drop_seed=o.pop("drop_seed", 0),
        worker_steps=o.pop("worker_steps", None),
        weighting=weighting,
        anomaly=o.pop("anomaly", None),
        membership=o.pop("membership", None),
    )
    return DiLoCo(
        inner=o.pop("inner_optimizer", None),
        outer=outer,
        schedule=None if fragments is None else Streaming(fragments, overlap, alpha),
        compression=o.pop("compression", None),
        weights=weights,
        delay=delay,
        state_sync=None if state_sync is None else StateSync(state_sync),
        gossip=gossip,
        outer_state_dtype=o.pop("outer_state_dtype", None),
    )


def only_optimizers(method: DiLoCo, caller: str, why: str) -> None:
    """Raises ValueError naming the first part of `method` besides inner / outer that is not
    at its default: `caller` (e.g. train_async) takes the optimizers only, for `why`."""
    for field in dataclasses.fields(DiLoCo):
        if field.name in ("inner", "outer"):
            continue
        value = getattr(method, field.name)
        default = _DEFAULTS[field.name]
        if field.name == "weights":  # exclusion resolves on by default: not a choice made
            value = dataclasses.replace(value, exclude_nonfinite=None)
        if value != default:
            raise ValueError(
                f"{caller} takes DiLoCo.inner and DiLoCo.outer only ({why}); got "
                f"{field.name}={value!r}"
            )


__all__ = [
    "DiLoCo",
    "Delayed",
    "Eager",
    "GASLoC",
    "NoLoCo",
    "NormSoftmax",
    "StateSync",
    "Streaming",
    "Weights",
    "default_inner_optimizer",
    "default_outer_optimizer",
    "method_from_options",
]
