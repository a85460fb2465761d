"""The trainer: what a training loop holds, turning gradients into rounds and rounds into updates.

The modules. ``peer`` (``AsyncPeer``: settings, the async front end, the step's work) and
``sync_peer`` (``Peer``, the same for ordinary loops; ``distributed_optimizer``: Horovod's
shape) over ``lifetime`` (the loop thread, open or closed: what both front ends drive, on a
``loopthread``). ``state`` (``TrainerState``) is the one owner of what the caller's thread and
the cluster's share, with the table of who calls what under which lock; ``contribution_decision``
decides, pure, when this member contributes and what. Its parts: ``contributions``
(``Contributor``: what the cluster calls, on its thread), ``updates`` (``Updater``: applying
updates, state loads, checkpoints' state), ``backward_feed`` and ``overlap`` (gradients into the
round's buffer as backward makes them), ``accumulator`` (the sum on the model's device; ``flat``:
its layout), ``apply`` (one update to the model), ``local_steps`` (DiLoCo; ``round_window``: its rounds by time), ``prediction``,
``pacing`` (when ``step`` waits), ``solo`` (a peer alone), ``step_checks``, ``options``,
``progress``, ``checkpoint`` (saving and resuming). ``host`` names what the parts read on the peer.

A gradient's trip, from ``Peer.step()`` to the ring:
``sync_peer.Peer.step`` -> ``lifetime.Lifetime.begin_step`` -> ``peer.AsyncPeer._begin_step``
(``state.TrainerState.batch_finished``; the batch times its size into ``accumulator.Accumulator.add``,
or already written by backward's hooks: ``backward_feed.BackwardFeed.filled``) -> the cluster is
told (``AsyncPeer._notify``) -> ``cluster.cluster`` asks ``contributions.Contributor.take`` ->
``contribution_decision.decide`` on ``TrainerState.view`` -> ``TrainerState.take_contribution``
(``Accumulator.swap``, ``to_host``) -> ``cluster.rings`` and ``collective.allreduce`` (the ring).
Which parameters had a gradient (``Accumulator.used``, ``Outgoing.used_flags``) goes with the
ring's DONE (``Contributor.used``), OR-ed into the COMMIT by the leader (``cluster.used``).
Meanwhile ``step`` waits where ``TrainerState.must_wait`` says (``pacing``), in
``Contributor.wait`` on the cluster's thread.

A committed update's trip back, to ``optimizer.step()``:
``cluster.cluster`` commits -> ``contributions.Contributor.apply`` -> ``TrainerState.update_committed``
(queued as an ``accumulator.CommittedUpdate``) -> ``updates.Updater.apply_queue`` (in ``step``:
``AsyncPeer._end_step``, or ``Contributor.wait`` while ``step`` blocks) -> ``apply.apply_update``
(``p.grad`` set to the mean, None where no member had a gradient, clipped) -> ``apply.optimizer_step`` -> ``optimizer.step()`` and the
scheduler (local steps: ``local_steps.LocalSteps.apply``, the outer step) ->
``TrainerState.update_applied`` (the version moves on).

May import: every layer below it (base, ``codecs``, ``net``, ``collective``, ``cluster``); no
import cycle within it (``tests/test_layout.py``).
"""
