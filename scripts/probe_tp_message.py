"""Host time of rank 0's step message in tensor parallelism: the tables compared, a StepInputs pickled and sent
over a pipe to a spawned process, at batch 1 and 64 (2000 steps each, after a warm-up round at batch 1)."""

import multiprocessing as mp
import pickle
import time

from yaie.engine.paged_runner import StepInputs


def drain(conn):
    while (data := conn.recv_bytes()) != b"stop":
        pickle.loads(data)


if __name__ == "__main__":
    ours, theirs = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=drain, args=(theirs,))
    proc.start()
    for batch in (1, 64, 1):             # the first round waits for the process to start
        inputs = StepInputs(list(range(batch)), [1] * batch, batch, [5] * batch, [200] * batch, [], list(range(batch)))
        tables = {i: list(range(i * 16, i * 16 + 16)) for i in range(batch)}
        sent, steps, began = dict(tables), 2000, time.perf_counter()
        for _ in range(steps):
            now = {s: tables[s] for s in inputs.seq_ids}
            changed = {s: t for s, t in now.items() if sent.get(s) != t}
            message = ("step", 0, StepInputs(inputs.seq_ids, inputs.query_lens, inputs.num_decodes, inputs.token_ids,
                                             inputs.positions, [], inputs.logit_rows), changed, [], batch)
            ours.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        print(f"batch {batch}: {(time.perf_counter() - began) / steps * 1e6:.1f} us per step")
    ours.send_bytes(b"stop")
    proc.join()
