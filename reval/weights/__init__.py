"""Weights from the learner to the generators, in one package.

==================  ===========================================================================
``sender``          the learner's side: ``WeightSender.send(model, version)`` on every rank
                    (gather in the compute dtype, pack into reused device buckets, broadcast,
                    file in the background); ``build_sender``
``receiver``        the generators' side: the ``WeightReceiver`` protocol every engine
                    implements (``engine.receiver``), ``LocalReceiver`` (next to a model: HF in
                    process, vLLM inside each of its workers) and the worker's
                    ``WeightSubscriber.update(receiver)``; ``build_subscriber``
``files``           the file transport and the Redis announcement (``WeightStore``), the
                    background ``FileWriter``
``collective``      the broadcast transport: ``BroadcastHub`` (learner rank 0) and
                    ``BroadcastReceiver`` (a thread next to each model) over torch.distributed
                    groups of their own (gloo on CPU, NCCL on GPU), elastic membership
``buckets``         the wire format both transports share: tensors packed into flat byte
                    buckets with a typed header; ``BufferPool``
==================  ===========================================================================

Which version a late joiner gets: the announced file (the newest one written, at most the
versions published while the previous file was being written behind the newest), then, once it
has joined the hub, every version broadcast after that.
"""

from reval.weights.buckets import Bucket, BufferPool, pack_buckets, plan_buckets, unpack_bucket
from reval.weights.collective import BroadcastHub, BroadcastReceiver
from reval.weights.files import UNREADABLE, Announcement, WeightStore, WeightWriteError
from reval.weights.receiver import LocalReceiver, WeightReceiver, WeightSubscriber
from reval.weights.sender import SendResult, WeightSender

__all__ = [
    "UNREADABLE",
    "Announcement",
    "BroadcastHub",
    "BroadcastReceiver",
    "Bucket",
    "BufferPool",
    "LocalReceiver",
    "SendResult",
    "WeightReceiver",
    "WeightSender",
    "WeightStore",
    "WeightSubscriber",
    "WeightWriteError",
    "pack_buckets",
    "plan_buckets",
    "unpack_bucket",
]
