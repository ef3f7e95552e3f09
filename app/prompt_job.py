"""A request whose prompt is too long to tokenize on the connection's reader thread.

Work of more than one slice never runs beside the engine on a reader's thread (app/budget.py): a
`generate` (or `next_token`) whose text is estimated over `work_slice_tokens` tokens (its bytes,
and the chat template's own around `messages`) is rendered and tokenized by the job runner
(app/jobs.py), in its fair queue, one slice between engine steps at a time (the chat template in
one slice, then the text about `work_slice_tokens` tokens of work a slice: Tokenizer.encode_steps).
Its last slice prepares the request from the token ids and submits it as a short prompt's is
submitted (Connection.start_request), so the replies are the same: `accepted`, the tokens, `done`.

Meanwhile the request holds one of the connection's `max_requests_per_connection`
(Connection.tokenizing). The checks that need its tokens (a prompt too long for the context, the
engine's queue, the connection's prompt tokens, a room's rules) come once it is tokenized, as
error replies with the same codes and parameters as a short prompt's. An `abort` (or the
connection closing) before `accepted` drops its job: the error `aborted` answers it, no request
is made, so no KV block is held. The message's work estimate, taken when it arrived, is settled
once its tokens are known to what a short prompt's is (its prompt tokens and stop checks; the
tokens alone if it was refused); one aborted, or failed, before then keeps its estimate.
"""

import itertools

from .protocol import error_reply
from .rooms import messages as room_messages

JOB_KIND = "request-prompt"        # the job runner's key: one job per request, never shared nor cached
_numbers = itertools.count()       # ... made unique by a number (a connection's id() can be reused)


class Withdrawn(Exception):
    """The request was aborted (or its connection closed) while its prompt was tokenized: its last
    slice enqueues nothing and answers nothing (the abort did)."""


def start_tokenizing(call, steps, params, format_output, accepted) -> None:
    """Hand the prompt's steps (a generator returning the token ids) to the job runner, and
    submit the request from its last slice (Call.submit's arguments otherwise). Raises at once
    what needs no tokens: a room's rules, the connection's request limit, a full job runner."""
    conn, mid = call.conn, call.id
    if conn.member is not None:                   # a room's student: the room's rules now (again at prepare)
        room_messages.ready(conn, *conn.member)
    conn.hold_tokenizing(mid)
    call.tokenized_by_job = True
    settle = call.settle_later()

    def work(engine):                             # on the engine loop's thread, a step a slice
        ids = yield from steps                    # an abort drops the job here (its estimate stays charged)
        try:
            conn.start_request(call, ids, params, format_output, accepted)
        except Withdrawn:
            pass
        finally:
            settle(max(call.cost, len(ids)))      # refused once tokenized: the tokenizing is still paid
        return None

    def subscriber(event) -> None:                # on the engine loop's thread: only queue
        if event.kind == "error" and conn.withdraw(mid):
            conn.send(error_reply(mid, event.error))

    runner = conn.runtime.jobs
    try:
        runner.submit(conn, mid, runner.key(JOB_KIND, {"n": next(_numbers)}), work, subscriber, cache=False)
    except BaseException:
        conn.withdraw(mid)
        raise
