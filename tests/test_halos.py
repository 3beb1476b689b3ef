"""HALoS (`train_async(..., server=dj.HALoS(...))`): a local parameter server per region under
a global one. Checked against a NumPy event simulation written here from the authors'
simulator's update order (Adam inner steps, local Nesterov, global heavy-ball, the merge
with weight α, latencies per hop), its degenerate case (one region is asynchronous DiLoCo),
times by hand, and its refusals."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data, np_adam, precision

import diloco_jax as dj
from diloco_jax import halos_replay
from diloco_jax.halos_clock import simulate

INNER_LR, LOCAL_LR, LOCAL_MOMENTUM, GLOBAL_LR, GLOBAL_MOMENTUM = 0.05, 0.6, 0.5, 0.8, 0.4
W0, B0 = [0.3, -0.2, 0.1], 0.5


def _np_halos(
    rounds, seconds, h, regions, k_push, alpha, worker_hop, region_hop, updates, record=None
):
    """float64 HALoS on the linear model [w0, w1, w2, b] in the authors' simulator's order:
    events in time order (server messages, then worker arrivals at one instant; ties by worker
    or region); an arriving worker's next job starts at once from the LPS's θ, and a message
    between the servers with no latency is handled as it is sent, after that.
    Returns (θ_G, [(time, worker, staleness, global updates, loss)]); `record`, a dict of
    lists, gets what a real run's servers write (`halos_replay`'s fields, as tuples)."""
    record = {"arrivals": [], "merges": [], "pushes": []} if record is None else record
    start_theta = np.array([*W0, B0], np.float64)
    glob = {"theta": start_theta.copy(), "v": np.zeros(4), "version": 0}
    local = [
        {"theta": start_theta.copy(), "v": np.zeros(4), "version": 0,
         "snap": start_theta.copy(), "merged": 0, "flight": False, "merges": 0, "seen": 0,
         "pushes": 0}
        for _ in range(max(regions) + 1)
    ]  # fmt: skip
    adam = [(np.zeros(4), np.zeros(4), 0) for _ in seconds]
    jobs = [0] * len(seconds)
    queue, count = [], [0]

    def post(time, kind, who, payload):
        count[0] += 1
        heapq.heappush(queue, (time, kind, who, count[0], payload))

    def start(m, at):
        lps = local[regions[m]]
        p = lps["theta"].copy()
        mo, ve, t = adam[m]
        losses = []
        for i in range(h):
            x = rounds[jobs[m]]["x"][m, i].astype(np.float64)
            y = rounds[jobs[m]]["y"][m, i].astype(np.float64)
            err = x @ p[:3] + p[3] - y
            losses.append(0.5 * np.mean(err**2))
            t += 1
            upd, mo, ve = np_adam(np.append(x.T @ err / len(err), err.mean()), mo, ve, t,
                                  INNER_LR)  # fmt: skip
            p = p + upd
        adam[m] = (mo, ve, t)
        jobs[m] += 1
        post(at + h * seconds[m] + worker_hop, 1, m,
             (lps["theta"] - p, lps["version"], np.mean(losses), jobs[m] - 1,
              lps["merges"]))  # fmt: skip

    def send(time, r, payload):
        if region_hop[r] > 0:
            post(time + region_hop[r], 0, r, payload)
        else:
            serve(time, payload)

    def serve(time, payload):
        what, r, value = payload[:3]
        if what == "push":
            record["pushes"].append((r, local[r]["pushes"] - 1, glob["version"] - local[r]["seen"]))
            glob["v"] = value + GLOBAL_MOMENTUM * glob["v"]
            glob["theta"] = glob["theta"] - GLOBAL_LR * glob["v"]
            glob["version"] += 1
            send(time, r, ("reply", r, glob["theta"].copy(), glob["version"]))
        else:
            lps = local[r]
            record["merges"].append((r, lps["version"], payload[3]))
            lps["merges"] += 1
            lps["seen"] = payload[3]
            lps["theta"] = (1 - alpha) * lps["theta"] + alpha * value
            lps["snap"], lps["merged"], lps["flight"] = lps["theta"].copy(), lps["version"], False

    for m in range(len(seconds)):
        start(m, worker_hop)
    out = []
    while len(out) < updates:
        time, kind, who, _, payload = heapq.heappop(queue)
        if kind == 0:
            serve(time, payload)
        else:
            delta, started, loss, job, merges = payload
            r = regions[who]
            lps = local[r]
            lps["v"] = delta + LOCAL_MOMENTUM * lps["v"]
            lps["theta"] = lps["theta"] - LOCAL_LR * (delta + LOCAL_MOMENTUM * lps["v"])
            staleness = lps["version"] - started
            record["arrivals"].append((r, who, job, h, started, merges, staleness, time))
            lps["version"] += 1
            push = None
            if not lps["flight"] and lps["version"] == lps["merged"] + k_push:
                lps["flight"] = True
                lps["pushes"] += 1
                push = ("push", r, lps["snap"] - lps["theta"])
            if len(out) + 1 < updates:
                start(who, time + worker_hop)
            if push is not None:
                send(time, r, push)
            if len(out) + 1 == updates:
                while queue and queue[0][:2] <= (time, 0):
                    item = heapq.heappop(queue)
                    serve(item[0], item[4])
            out.append((time, who, staleness, glob["version"], loss))
    return glob["theta"], out


def _params(dtype):
    return {"w": np.asarray(W0, dtype), "b": dtype(B0)}


def _run(rounds, seconds, h, updates, dtype=np.float32, outer=None, **spec):
    spec.setdefault("global_optimizer", optax.sgd(GLOBAL_LR, momentum=GLOBAL_MOMENTUM))
    return dj.train_async(
        linear_loss, _params(dtype), rounds, num_workers=len(seconds), inner_steps=h,
        num_updates=updates, step_seconds=seconds, inner_optimizer=optax.adam(INNER_LR),
        outer_optimizer=outer or optax.sgd(LOCAL_LR, momentum=LOCAL_MOMENTUM, nesterov=True),
        server=dj.HALoS(**spec),
    )  # fmt: skip


CASES = [
    # seconds, regions, K, alpha, worker hop, region hops
    ((1.0, 1.5, 2.0, 3.0), (0, 0, 1, 1), 2, 0.25, 0.1, (0.3, 1.7)),
    ((1.0, 1.0, 2.5, 0.5), (0, 1, 1, 0), 1, 0.5, 0.0, (0.0, 2.0)),
    ((1.0, 2.0, 3.0), (0, 1, 2), 3, 1.0, 0.25, (0.5, 0.5, 4.0)),
]


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-12), ("float32", 3e-5)])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_numpy_reference(case, dtype, tol):
    seconds, regions, k_push, alpha, worker_hop, region_hops = case
    updates, h = 14, 2
    rounds = make_data(np.random.default_rng(7), 20, len(seconds), h)
    want, events = _np_halos(rounds, seconds, h, regions, k_push, alpha, worker_hop,
                             region_hops, updates)  # fmt: skip
    with precision(dtype):
        result = _run(rounds, seconds, h, updates, np.dtype(dtype).type, regions=regions,
                      local_updates=k_push, merge_weight=alpha, worker_seconds=worker_hop,
                      region_seconds=region_hops)  # fmt: skip
        got = np.append(np.asarray(result.params["w"]), result.params["b"])
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    hist = result.history
    assert [(x["time"], x["worker"], x["staleness"], x["global_updates"]) for x in hist] == [
        e[:4] for e in events
    ]
    np.testing.assert_allclose(
        [x["loss"] for x in hist], [e[4] for e in events], rtol=max(tol, 3e-6)
    )
    assert [x["region"] for x in hist] == [regions[e[1]] for e in events]


@pytest.mark.parametrize("case", CASES)
def test_a_record_of_the_servers_events_replays_to_the_reference(case):
    # What a real run's servers write (each LPS's arrivals with where their jobs started, its
    # merges, the GPS's pushes), taken from the NumPy run, replayed in place of the clock.
    seconds, regions, k_push, alpha, worker_hop, region_hops = case
    updates, h = 14, 2
    rounds = make_data(np.random.default_rng(7), 20, len(seconds), h)
    events = {"arrivals": [], "merges": [], "pushes": []}
    want, _ = _np_halos(rounds, seconds, h, regions, k_push, alpha, worker_hop, region_hops,
                        updates, record=events)  # fmt: skip
    assert events["merges"] and events["pushes"]
    record = halos_replay.Record(events["arrivals"], events["merges"], events["pushes"])
    spec = {"regions": regions, "local_updates": k_push, "merge_weight": alpha}
    with precision("float64"):
        result = _replay(rounds, h, record, spec)
        got = np.append(np.asarray(result.params["w"]), result.params["b"])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        assert [x["worker"] for x in result.history] == [a[1] for a in events["arrivals"]]
        # Control: the GPS's first two pushes of different regions applied the other way
        # round (every merge still finds its version) land elsewhere.
        pushes = list(record.pushes)
        i = next(i for i in range(len(pushes) - 1) if pushes[i][0] != pushes[i + 1][0])
        pushes[i], pushes[i + 1] = pushes[i + 1], pushes[i]
        moved = _replay(rounds, h, record._replace(pushes=tuple(pushes)), spec)
        assert not np.allclose(np.asarray(moved.params["w"]), want[:3], rtol=1e-6)


def _replay(rounds, h, record, spec, **options):
    return dj.train_async(
        linear_loss, _params(np.float64), rounds, num_workers=len(spec["regions"]),
        inner_steps=h, num_updates=len(record.arrivals), arrivals=record,
        inner_optimizer=optax.adam(INNER_LR),
        outer_optimizer=optax.sgd(LOCAL_LR, momentum=LOCAL_MOMENTUM, nesterov=True),
        server=dj.HALoS(global_optimizer=optax.sgd(GLOBAL_LR, momentum=GLOBAL_MOMENTUM), **spec),
        **options,
    )  # fmt: skip


# Region 1's θ_G takes 3 s to come back, while region 0 pushes: its next push's age counts
# the GPS updates since the θ_G it merged, those made while that θ_G was on its way included.
LONG_REPLY = ((1.0, 1.5, 2.0, 3.0), (0, 0, 1, 1), 1, 0.5, 0.1, (0.2, 3.0))


@pytest.mark.parametrize("case", [*CASES, LONG_REPLY])
def test_the_simulated_clock_writes_the_references_events(case):
    # The clock orders the events only; its record is the NumPy run's, event by event: each
    # arrival's job, start and time, each merge's θ_G version, each GPS update's age.
    seconds, regions, k_push, alpha, worker_hop, region_hops = case
    rounds = make_data(np.random.default_rng(7), 30, len(seconds), 2)
    events = {"arrivals": [], "merges": [], "pushes": []}
    _np_halos(rounds, seconds, 2, regions, k_push, alpha, worker_hop, region_hops, 24,
              record=events)  # fmt: skip
    spec = dj.HALoS(regions=regions, local_updates=k_push, merge_weight=alpha,
                    worker_seconds=worker_hop, region_seconds=region_hops)  # fmt: skip
    record = simulate(spec, seconds, (2,) * len(seconds), 24).record
    assert [tuple(a) for a in record.arrivals[:24]] == events["arrivals"]
    # The reference stops at the 24th arrival; the clock looks on to the jobs still running.
    merges, pushes = [m[:3] for m in record.merges], [p[:3] for p in record.pushes]
    assert merges[: len(events["merges"])] == events["merges"]
    assert pushes[: len(events["pushes"])] == events["pushes"]
    assert any(p.staleness for p in record.pushes)  # ages that a slower hop makes


def test_a_replay_of_a_record_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    seconds, regions, k_push, alpha, worker_hop, region_hops = CASES[0]
    rounds = make_data(np.random.default_rng(7), 20, len(seconds), 2)
    events = {"arrivals": [], "merges": [], "pushes": []}
    _np_halos(rounds, seconds, 2, regions, k_push, alpha, worker_hop, region_hops, 14,
              record=events)  # fmt: skip
    record = halos_replay.Record(events["arrivals"], events["merges"], events["pushes"])
    spec = {"regions": regions, "local_updates": k_push, "merge_weight": alpha}

    def die_after_6(entry):
        if entry["update"] == 6:
            raise KeyboardInterrupt

    with precision("float64"):
        whole = _replay(rounds, 2, record, spec)
        with pytest.raises(KeyboardInterrupt):
            _replay(rounds, 2, record, spec, checkpoint_dir=tmp_path, checkpoint_every=4,
                    callback=die_after_6)  # fmt: skip
        assert dj.checkpoint.latest_step(tmp_path) == 4
        resumed = _replay(rounds, 2, record, spec, checkpoint_dir=tmp_path, checkpoint_every=4)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, whole.state)
    assert resumed.history == whole.history


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r._replace(arrivals=r.arrivals[:-1]), "num_updates = 14"),
        (
            lambda r: r._replace(arrivals=((1, *r.arrivals[0][1:]),) + r.arrivals[1:]),
            r"arrivals\[0\] can't be replayed: worker 0 is not in region 1",
        ),
        (
            lambda r: r._replace(arrivals=(r.arrivals[0]._replace(start=3),) + r.arrivals[1:]),
            r"arrivals\[0\] can't be replayed: a job from update 3",
        ),
        (lambda r: r._replace(pushes=((0, -1, 0),)), r"pushes\[0\] can't be replayed"),
        (lambda r: ("not", "a record"), "must be a halos.Record"),
    ],
)
def test_a_record_that_cant_be_the_run_is_refused(edit, message):
    seconds, regions, k_push, alpha, worker_hop, region_hops = CASES[0]
    rounds = make_data(np.random.default_rng(7), 20, len(seconds), 2)
    events = {"arrivals": [], "merges": [], "pushes": []}
    _np_halos(rounds, seconds, 2, regions, k_push, alpha, worker_hop, region_hops, 14,
              record=events)  # fmt: skip
    record = halos_replay.checked(
        (events["arrivals"], events["merges"], events["pushes"]), regions, 2, 14
    )
    with pytest.raises(ValueError, match=message):
        dj.train_async(
            linear_loss, _params(np.float32), rounds, num_workers=4, inner_steps=2,
            num_updates=14, arrivals=edit(record), server=dj.HALoS(regions=regions),
        )  # fmt: skip


def test_one_region_is_asynchronous_diloco_with_the_local_rule():
    # K = 1, α = 1, no latency, a global SGD(1.0): θ_G = θ_L after every update. No two
    # arrivals at one instant (HALoS answers tied workers in turn, train_async together).
    seconds, h, updates = (1.0, 2.2, 3.3), 2, 11
    rounds = make_data(np.random.default_rng(8), 8, 3, h)
    outer = dj.delayed_nesterov(0.6, 0.5, buffer_size=2)
    with precision("float64"):
        halos = _run(
            rounds,
            seconds,
            h,
            updates,
            np.float64,
            outer=outer,
            regions=(0, 0, 0),
            local_updates=1,
            merge_weight=1.0,
            global_optimizer=optax.sgd(1.0),
        )
        plain = dj.train_async(
            linear_loss, _params(np.float64), rounds, num_workers=3, inner_steps=h,
            num_updates=updates, step_seconds=seconds, inner_optimizer=optax.adam(INNER_LR),
            outer_optimizer=outer,
        )  # fmt: skip
    for name in ("w", "b"):
        np.testing.assert_allclose(halos.params[name], plain.params[name], rtol=1e-12, atol=1e-14)
    keys = ("time", "worker", "staleness", "steps", "total_steps", "loss", "worker_bytes")
    assert [{k: x[k] for k in keys} for x in halos.history] == [
        {k: x[k] for k in keys} for x in plain.history
    ]


def test_a_hop_of_zero_is_the_limit_of_small_hops():
    # The authors' order: a worker's next job starts from the θ_L of its arrival, before the
    # push that arrival set off comes back merged, however short the hops. (Handling the
    # zero-latency messages before the worker's answer moved θ_G by ~0.2 here.)
    rounds = make_data(np.random.default_rng(10), 12, 1, 2)
    spec = dict(regions=(0,), local_updates=2, merge_weight=0.5)
    with precision("float64"):  # 7 updates: the last sets off no push, due or not
        runs = [_run(rounds, (1.0,), 2, 7, np.float64, region_seconds=hop, **spec)
                for hop in (0.0, 1e-9)]  # fmt: skip
    for name in ("w", "b"):
        np.testing.assert_allclose(runs[0].params[name], runs[1].params[name], rtol=1e-12)
    assert [x["global_updates"] for x in runs[0].history] == [0, 1, 1, 2, 2, 3, 3]


def test_times_and_bytes_by_hand():
    # Two regions of one worker each, step 1 s, H = 2, a 0.5 s worker hop: worker 0 starts at
    # 0.5, arrives at its LPS at 3.0, restarts at 3.5, arrives at 6.0; worker 1 (3 s steps)
    # arrives at 0.5 + 6 + 0.5 = 7.0. With K = 1 each arrival pushes |θ| = 16 B to the GPS.
    rounds = make_data(np.random.default_rng(9), 4, 2, 2)
    result = _run(rounds, (1.0, 3.0), 2, 3, regions=(0, 1), local_updates=1,
                  worker_seconds=0.5, region_seconds=(1.0, 2.0))  # fmt: skip
    hist = result.history
    assert [(x["time"], x["worker"]) for x in hist] == [(3.0, 0), (6.0, 0), (7.0, 1)]
    # The GPS applies region 0's first push at 4.0; its second (sent at 6.0, after the reply
    # reached the LPS at 5.0) at 7.0, before worker 1's arrival at that instant.
    assert [x["global_updates"] for x in hist] == [0, 1, 2]
    assert hist[-1]["region_bytes"] == [32, 16]
    assert hist[-1]["worker_bytes"] == [32, 16]
    # Busy: worker 0 computes [0.5, 2.5], [3.5, 5.5], [6.5, 7]; worker 1 [0.5, 6.5].
    assert result.utilization == pytest.approx((2 + 2 + 0.5 + 6) / (2 * 7.0))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"regions": (0, 2)}, "HALoS.regions"),
        ({"regions": [0, 1]}, "HALoS.regions"),
        ({"regions": (0, 1), "local_updates": 0}, "HALoS.local_updates"),
        ({"regions": (0, 1), "merge_weight": 1.5}, "HALoS.merge_weight"),
        ({"regions": (0, 1), "worker_seconds": -1.0}, "HALoS.worker_seconds"),
        ({"regions": (0, 1), "region_seconds": (1.0,)}, "HALoS.region_seconds"),
        ({"regions": (0, 1), "region_seconds": float("nan")}, "HALoS.region_seconds"),
        ({"regions": (0, 1), "global_optimizer": "adam"}, "HALoS.global_optimizer"),
    ],
)
def test_bad_fields_name_themselves(spec, message):
    with pytest.raises(ValueError, match=message):
        dj.HALoS(**spec)


def test_regions_must_cover_every_worker():
    rounds = make_data(np.random.default_rng(0), 4, 3, 2)
    with pytest.raises(ValueError, match="num_workers = 3 regions"):
        _run(rounds, (1.0, 1.0, 1.0), 2, 2, regions=(0, 1))
    with pytest.raises(ValueError, match="server must be None"):
        dj.train_async(linear_loss, _params(np.float32), rounds, num_workers=3, inner_steps=2,
                       num_updates=2, step_seconds=(1.0,) * 3, server="halos")  # fmt: skip


def test_arrivals_are_known_before_training():
    seconds, h = (1.0, 1.5, 4.0, 0.5), 2
    rounds = make_data(np.random.default_rng(10), 30, 4, h)
    spec = {"regions": (0, 1, 1, 0), "local_updates": 2, "worker_seconds": 0.25,
            "region_seconds": (0.5, 1.0)}  # fmt: skip
    result = _run(rounds, seconds, h, 12, **spec)
    want = dj.HALoS(**spec).arrivals(seconds, (h,) * 4, 12)
    assert [(x["time"], x["worker"]) for x in result.history] == list(want)


@pytest.mark.parametrize(
    "server",
    [None, dj.HALoS(regions=(0, 0, 1)), dj.DecoupledDiLoCo(quorum=2, grace_seconds=1.0)],
)
def test_an_lm_async_run_is_sized_to_the_inner_step_budget(server):
    from diloco_jax.decoupled import steps_by
    from diloco_jax.lm import experiment
    from diloco_jax.lm.config import make_config

    seconds = (0.5, 1.0, 2.5)
    cfg = make_config("quick", workers=3, inner_steps=4, rounds=5, step_seconds=seconds)
    budget = 3 * cfg.total_steps
    count = experiment._updates_for(cfg, seconds, budget, server)
    if isinstance(server, dj.DecoupledDiLoCo):
        syncs = server.schedule(seconds, 4, count)
        done = [sum(steps_by(s.time, x) for x in seconds) for s in syncs]
    else:
        ends = (
            dj.async_schedule(seconds, 4, count).events
            if server is None
            else server.arrivals(seconds, (4,) * 3, count)
        )
        done = np.cumsum([4] * len(ends))
    assert done[-1] >= budget > done[-2]


def test_too_few_rounds_name_data():
    rounds = make_data(np.random.default_rng(0), 2, 2, 2)
    with pytest.raises(ValueError, match="data has 2 rounds"):
        _run(rounds, (1.0, 4.0), 2, 6, regions=(0, 1))


@pytest.mark.parametrize("hops", [(0.1, (0.3, 1.7)), (0.0, 0.0)], ids=["latencies", "none"])
def test_a_run_killed_and_resumed_from_its_checkpoint_equals_the_uninterrupted_run(hops, tmp_path):
    """Checkpoints every 3 updates; a crash after update 7 resumes from the one after 6 (jobs
    and server messages in flight across the cut) and ends bit for bit as the run that never
    stopped; a finished run of 9 resumed for 14 equals 14 at once."""
    worker_hop, region_hops = hops
    rounds = make_data(np.random.default_rng(11), 12, 4, 2)
    spec = dict(regions=(0, 0, 1, 1), local_updates=2, merge_weight=0.25,
                worker_seconds=worker_hop, region_seconds=region_hops)  # fmt: skip
    seconds = (1.0, 1.5, 2.0, 3.0)

    def run(updates, **options):
        return dj.train_async(
            linear_loss, _params(np.float32), rounds, num_workers=4, inner_steps=2,
            num_updates=updates, step_seconds=seconds, inner_optimizer=optax.adam(INNER_LR),
            outer_optimizer=optax.sgd(LOCAL_LR, momentum=LOCAL_MOMENTUM, nesterov=True),
            eval_fn=lambda p: {"eval_loss": jnp.sum(p["w"] ** 2)}, eval_every=3,
            server=dj.HALoS(global_optimizer=dj.delayed_nesterov(0.5, 0.5, buffer_size=2),
                            **spec),
            **options,
        )  # fmt: skip

    full = run(14)
    crash = tmp_path / "crash"

    def die_after_7(entry):
        if entry["update"] == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(14, checkpoint_dir=crash, checkpoint_every=3, callback=die_after_7)
    assert dj.checkpoint.latest_step(crash) == 6
    resumed = run(14, checkpoint_dir=crash, checkpoint_every=3)
    jax.tree.map(np.testing.assert_array_equal, resumed.state, full.state)
    assert resumed.history == full.history
    assert (resumed.elapsed_seconds, resumed.utilization) == (
        full.elapsed_seconds, full.utilization,
    )  # fmt: skip
    longer = tmp_path / "longer"
    run(9, checkpoint_dir=longer, checkpoint_every=4)
    again = run(14, checkpoint_dir=longer, checkpoint_every=4)
    jax.tree.map(np.testing.assert_array_equal, again.state, full.state)
    keys = ("update", "time", "worker", "staleness", "global_updates", "loss", "region_bytes")
    assert [{k: x[k] for k in keys} for x in again.history] == [
        {k: x[k] for k in keys} for x in full.history
    ]
    with pytest.raises(ValueError, match="checkpoint_dir"):  # another spec: another run
        dj.train_async(
            linear_loss, _params(np.float32), rounds, num_workers=4, inner_steps=2,
            num_updates=14, step_seconds=seconds, checkpoint_dir=longer,
            server=dj.HALoS(**{**spec, "local_updates": 3}),
        )  # fmt: skip
