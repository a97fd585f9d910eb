"""Pushing messages to the nodes and pulling their replies: one phase of a round.

:func:`exchange` is the one push/pull loop of the server: the round loop's ``send`` and the
runner's counting grid (its ``send_and_receive``) run it. With ``on_reply`` every reply is
handed over as it is pulled, so a round holds at most one serialized reply at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid

from fedmm.interrupt import STOP, raise_if_stopped

#: Seconds between two pulls while replies are outstanding (a reply waits at most this long
#: in the SuperLink before the server sees it).
POLL_INTERVAL = 0.01


def exchange(
    grid: Grid,
    messages: list[Message],
    timeout: float | None,
    on_reply: Callable[[Message], None] | None = None,
    poll_interval: float = POLL_INTERVAL,
) -> list[Message]:
    """Push ``messages`` and pull their replies until all are in, ``timeout`` seconds pass
    (None: no limit) or a stop is requested (:mod:`fedmm.interrupt`).

    The list is emptied once pushed, so that only the grid holds the messages until their
    replies are in. With ``on_reply`` each reply is handed to it as soon as it is pulled and not
    kept (an empty list is returned); without, the replies are returned. A pull that brought
    replies is followed by the next at once (more may be in); one that brought none by a wait of
    ``poll_interval``.
    """
    raise_if_stopped()
    pending = set(grid.push_messages(messages))
    messages.clear()
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    replies: list[Message] = []
    while pending:
        pulled = list(grid.pull_messages(pending))
        got = bool(pulled)
        while pulled:
            reply = pulled.pop(0)  # the pulled list does not keep a handled reply alive
            pending.discard(reply.metadata.reply_to_message_id)
            if on_reply is None:
                replies.append(reply)
            else:
                on_reply(reply)
            del reply  # nor does this frame while the next one is pulled
        if not pending or time.monotonic() >= deadline:
            break
        if got:
            raise_if_stopped()
        elif STOP.wait(poll_interval):
            raise_if_stopped()
    return replies
