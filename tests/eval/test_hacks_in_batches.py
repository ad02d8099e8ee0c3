"""What a red team made ``execpool eval``'s samples do to their scores and
their batch-mates' (docs/batch/evaluation.md, "Batches"), each failing on
the code before its fix: a judge killed by a module the sample named (an
Internal Error, never scored, which raised pass@k), builtins redefined
under assert-style tests, a retry alone used to leave the sample's layer,
and batch-mates talking over loopback TCP."""

from __future__ import annotations

import pytest

from execpool import ExecPool
from execpool.eval import EvalOptions, evaluate, load_problems

ADD = {"task_id": "p/add", "test_list": ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(0, 0) == 0"]}
SIM = {"task_id": "p/sim", "test_list": [
    "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
    "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
    "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"]}
AREA = {"task_id": "p/area", "test_list": ["assert abs(area(2) - 12.566) < 0.01", "assert abs(area(1) - 3.1416) < 0.01"]}
PROBLEMS = load_problems([ADD, SIM, AREA])

GOOD_ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"

#: A wrong sample that names a fake module: its judge imports
#: ``venv.__main__``, whose argparse raises SystemExit in the judge.
UNSCORED = WRONG_ADD + "import types\n_x = types.ModuleType('venv.__main__')\n"

#: Wrong samples that shadow the builtin the asserts wrap their call in.
SET_SHADOW = "def similar_elements(a, b):\n    return None\ndef set(*args):\n    return 0\n"
ABS_SHADOW = "def area(r):\n    return 0\ndef abs(x):\n    return 0\n"



@pytest.fixture(scope="module", params=["strict", None], ids=["sandbox", "no-sandbox"])
def pool(request):
    kwargs = {"sandbox": request.param} if request.param else {}
    with ExecPool(workers=1, **kwargs) as p:
        yield p


def run(pool, samples, batch=8, timeout=3.0):
    options = EvalOptions(timeout=timeout, batch=batch)
    return evaluate(pool, samples, PROBLEMS, ks=(1,), options=options, max_in_flight=1)


@pytest.mark.parametrize("batch", [8, 1])
def test_a_wrong_sample_cannot_make_itself_unscored(pool, batch):
    # Found: the judge imports whatever stdlib module the sample's greeting
    # names, catching only Exception; venv.__main__ raises SystemExit, the
    # judge exits 1, the leader says Internal Error, the retry alone does
    # the same: the wrong sample is never scored and pass@1 goes up.
    result = run(pool, [{"task_id": "p/add", "completion": UNSCORED},
                        {"task_id": "p/add", "completion": GOOD_ADD}], batch=batch)
    verdicts = [r["verdict"] for r in result.records]
    assert verdicts[0] != "Internal Error", verdicts
    assert result.records[0]["passed"] is False
    assert result.summary["pass@1"] == 0.5, result.summary


@pytest.mark.slow
@pytest.mark.parametrize("completion,task", [(SET_SHADOW, "p/sim"), (ABS_SHADOW, "p/area")], ids=["set", "abs"])
def test_a_sample_cannot_pass_asserts_by_redefining_a_builtin(pool, completion, task):
    # Found: an assert-style sample's every function becomes a remote call
    # in the tests' namespace, builtins included (judge.py _namespace), so
    # ``set(f(x)) == set(y)`` calls the sample's ``set`` on both sides.
    result = run(pool, [{"task_id": task, "completion": completion}])
    assert result.records[0]["verdict"] != "Accepted", result.records[0]


#: Fails its judge only inside a batch (its directory is ``sample-N``), so
#: it is judged again alone -- where, without the sandbox, no layer holds
#: it -- and there reads the code of samples of other batches.
ESCAPER = r'''
import os, types, glob
if os.path.basename(os.getcwd()).startswith('sample-'):
    _x = types.ModuleType('venv.__main__')
def add(a, b):
    found = []
    for p in glob.glob('/tmp/execpool-*/*/sample-*/sample.py'):
        try:
            t = open(p).read()
        except OSError:
            continue
        if 'RT46-SECRET-MARKER' in t:
            found.append(p)
    return found
'''
VICTIM = "# RT46-SECRET-MARKER\ndef add(a, b):\n    import time\n    time.sleep(2)\n    return a + b\n"


@pytest.mark.slow
def test_a_sample_cannot_leave_its_layer_by_failing_its_batch():
    # Found (--no-sandbox): an Internal Error the sample causes only in a
    # batch sends it to a job of its own, without a Landlock layer; there
    # it reads (and, as the pool's user, could write or SIGKILL) the
    # samples of batches running beside it.
    samples = [{"task_id": "p/add", "completion": c} for c in (VICTIM, GOOD_ADD, ESCAPER, GOOD_ADD)]
    with ExecPool(workers=2) as bare:
        result = evaluate(bare, samples, PROBLEMS, ks=(1,), options=EvalOptions(timeout=10.0, batch=2),
                          max_in_flight=2)
    actual = str((result.records[2]["first_failure"] or {}).get("actual"))
    assert "sample.py" not in actual, actual


#: Two samples of one batch: the first serves sums on loopback TCP, the
#: second has no addition of its own and asks the first.
SERVER = r'''
import socket, threading
def _serve():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('127.0.0.1', 47125)); s.listen(16)
    while True:
        c, _ = s.accept()
        a, b = map(int, c.recv(100).split())
        c.sendall(str(a + b).encode()); c.close()
threading.Thread(target=_serve, daemon=True).start()
def add(a, b):
    import time; time.sleep(1.5)
    return a + b
'''
ASKER = r'''
import socket, time
def add(a, b):
    for _ in range(100):
        try:
            c = socket.create_connection(('127.0.0.1', 47125), timeout=5)
            break
        except OSError:
            time.sleep(0.02)
    else:
        return None
    c.sendall(b'%d %d' % (a, b)); return int(c.recv(100))
'''


@pytest.mark.slow
def test_samples_of_a_batch_cannot_talk_over_loopback(pool):
    # Found: the layer scopes signals and abstract sockets, not TCP (nor
    # UDP): batch-mates share the job's network namespace, so one sample
    # passes on another's answers (pass@k of colluding samples inflated).
    result = run(pool, [{"task_id": "p/add", "completion": SERVER}, {"task_id": "p/add", "completion": ASKER}],
                 timeout=8.0)
    assert result.records[1]["verdict"] != "Accepted", result.records[1]
