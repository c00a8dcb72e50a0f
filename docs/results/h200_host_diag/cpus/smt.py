"""Scratch: do some of the 16 vCPUs share a physical core? Two pinned busy Python loops, every pair."""
import itertools, multiprocessing as mp, os, time

def work(cpu, start, q):
    os.sched_setaffinity(0, {cpu})
    while time.time() < start:
        pass
    t0 = time.perf_counter(); x = 0
    for i in range(1_500_000):
        x += i * i
    q.put((cpu, time.perf_counter() - t0))

def run(cpus):
    q = mp.Queue(); start = time.time() + 0.05
    ps = [mp.Process(target=work, args=(c, start, q)) for c in cpus]
    [p.start() for p in ps]; res = dict(q.get() for _ in cpus); [p.join() for p in ps]
    return res

if __name__ == "__main__":
    n = os.cpu_count()
    alone = {c: min(run([c])[c] for _ in range(2)) for c in range(n)}
    print("alone s:", " ".join(f"{c}:{alone[c]:.3f}" for c in range(n)))
    slow = []
    for a, b in itertools.combinations(range(n), 2):
        r = run([a, b])
        f = max(r[a] / alone[a], r[b] / alone[b])
        if f > 1.25:
            slow.append((a, b, round(f, 2)))
    print("pairs slowed > 1.25x:", slow)
    for c in range(n):
        try:
            print(c, open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip(),
                  open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id").read().strip())
        except OSError as e:
            print(c, e)
