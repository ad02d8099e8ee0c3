/* Start one tool: vfork + everything that must happen before exec.
 *
 * Runs inside a worker (execpool/spawn.py). A Python-level fork of the
 * worker costs milliseconds here -- the child copies page tables, takes
 * copy-on-write faults and tears the copy down again at exec -- while vfork
 * borrows the parent's memory until exec. subprocess uses vfork too, but it
 * cannot set rlimits or the parent-death signal in the child, and applying
 * them after exec leaves a window in which the tool (or a child it forks)
 * runs unlimited. So this does what glibc's posix_spawn does, plus those two:
 * new session, PR_SET_PDEATHSIG, working directory, stdin/stdout/stderr,
 * every other descriptor closed, rlimits, then execve. Only
 * async-signal-safe calls run in the child; every allocation happens in the
 * parent before vfork; the child reports a failure through memory it shares
 * with the parent until exec.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436 /* the same number on every architecture */
#endif

static const int limit_resources[] = {RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE};
#define N_LIMITS 4
#define MAX_JOIN_FDS 8

static const char *const step_names[] = {
    "setsid", "prctl(PR_SET_PDEATHSIG)", "setrlimit", "chdir", "dup2", "execve", "unshare(CLONE_NEWNET)",
    "joining the job's cgroup", "close_range",
};

static void free_vector(char **vector) {
    if (vector == NULL)
        return;
    for (char **p = vector; *p != NULL; p++)
        PyMem_Free(*p);
    PyMem_Free(vector);
}

/* A NULL-terminated copy of a sequence of str/bytes, made before vfork. */
static char **to_vector(PyObject *seq, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **vector = PyMem_Calloc(n + 1, sizeof(char *));
    if (vector == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *bytes = NULL;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(fast, i), &bytes)) {
            free_vector(vector);
            Py_DECREF(fast);
            return NULL;
        }
        Py_ssize_t size = PyBytes_GET_SIZE(bytes);
        vector[i] = PyMem_Malloc(size + 1);
        if (vector[i] == NULL) {
            Py_DECREF(bytes);
            free_vector(vector);
            Py_DECREF(fast);
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(vector[i], PyBytes_AS_STRING(bytes), size + 1);
        Py_DECREF(bytes);
    }
    Py_DECREF(fast);
    return vector;
}

/* Copy a sequence of at most `max` ints into `out`; the count, or -1 with
 * an exception set. */
static Py_ssize_t to_numbers(PyObject *seq, long long *out, Py_ssize_t max, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > max) {
        PyErr_Format(PyExc_ValueError, "%s: at most %zd entries", what, max);
        n = -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            n = -1;
            break;
        }
    }
    Py_DECREF(fast);
    return n;
}

/* Shared with the vfork child until it execs or exits. */
static volatile int child_errno;
static volatile int child_step;

static void child(char **argv, char **envp, const char *cwd, const long long *limits, int stdin_fd,
                  int out_fd, int err_fd, int no_network, const int *join_fds, Py_ssize_t n_join, pid_t parent,
                  const sigset_t *old_mask) {
    int step = 7;
    /* "0" names the writer itself: the tool is in its job's cgroup before
     * it can fork anything. */
    for (Py_ssize_t i = 0; i < n_join; i++)
        if (write(join_fds[i], "0", 1) != 1)
            goto fail;
    step = 0;
    if (setsid() < 0)
        goto fail;
    step = 6;
    if (no_network && unshare(CLONE_NEWNET) < 0)
        goto fail;
    step = 1;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        goto fail;
    if (getppid() != parent)
        _exit(137); /* the worker died before the death signal was armed */
    step = 3;
    if (chdir(cwd) < 0)
        goto fail;
    step = 4;
    if (dup2(stdin_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)
        goto fail;
    /* Nothing but 0, 1 and 2 reaches a tool, whatever the worker holds and
     * whether or not it is close-on-exec (a descriptor received over a
     * socket is not, unless asked). Before the rlimits: a lowered open-files
     * limit hides nothing from close_range, but a loop up to it would miss
     * what lies above. */
    step = 8;
    if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0) {
        if (errno != ENOSYS)
            goto fail;
        struct rlimit open_files;
        if (getrlimit(RLIMIT_NOFILE, &open_files) < 0)
            goto fail;
        for (rlim_t fd = 3; fd < open_files.rlim_cur; fd++)
            close((int)fd);
    }
    step = 2;
    for (int i = 0; i < N_LIMITS; i++) {
        if (limits[i] < 0)
            continue;
        struct rlimit current, wanted;
        if (getrlimit(limit_resources[i], &current) < 0)
            goto fail;
        rlim_t value = (rlim_t)limits[i];
        if (current.rlim_max != RLIM_INFINITY && value > current.rlim_max)
            value = current.rlim_max;
        wanted.rlim_cur = wanted.rlim_max = value;
        if (setrlimit(limit_resources[i], &wanted) < 0)
            goto fail;
    }
    /* The worker's handlers must not run here (they would touch the
     * parent's memory), and what the worker ignores -- SIGPIPE, SIGXFSZ,
     * as Python does -- the tool must not inherit ignored. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP || sigaction(sig, NULL, &old) < 0)
            continue;
        if (old.sa_handler != SIG_DFL)
            sigaction(sig, &dfl, NULL);
    }
    sigprocmask(SIG_SETMASK, old_mask, NULL);
    step = 5;
    execve(argv[0], argv, envp);
fail:
    child_errno = errno;
    child_step = step;
    _exit(127);
}

PyDoc_STRVAR(spawn_doc,
"spawn(argv, env, cwd, limits, stdin_fd, out_fd, err_fd, no_network, join_fds) -> pid\n\n"
"Start argv[0] (an absolute path) in a new session with env (a list of\n"
"'KEY=value'), the parent-death signal SIGKILL, the rlimits (address space,\n"
"CPU seconds, file size, open files; -1 leaves one unchanged) applied as\n"
"both soft and hard limits, cwd as working directory, stdin from stdin_fd,\n"
"stdout on out_fd and stderr on err_fd (the same pipe to merge them), in a\n"
"network namespace of its own (only a loopback that is down) when\n"
"no_network is true, after writing \"0\" to each of join_fds (open\n"
"cgroup.procs files). Raises OSError naming the step that failed.");

static PyObject *spawn(PyObject *self, PyObject *args) {
    PyObject *argv_obj, *env_obj, *cwd_obj, *limits_obj, *join_obj;
    int stdin_fd, out_fd, err_fd, no_network;
    if (!PyArg_ParseTuple(args, "OOO&OiiipO", &argv_obj, &env_obj, PyUnicode_FSConverter, &cwd_obj,
                          &limits_obj, &stdin_fd, &out_fd, &err_fd, &no_network, &join_obj))
        return NULL;
    long long limits[N_LIMITS], join[MAX_JOIN_FDS];
    int join_fds[MAX_JOIN_FDS];
    char **argv = NULL, **envp = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_limits = to_numbers(limits_obj, limits, N_LIMITS, "limits");
    if (n_limits < 0)
        goto done;
    if (n_limits != N_LIMITS) {
        PyErr_SetString(PyExc_ValueError, "limits must have 4 entries");
        goto done;
    }
    Py_ssize_t n_join = to_numbers(join_obj, join, MAX_JOIN_FDS, "join_fds");
    if (n_join < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n_join; i++)
        join_fds[i] = (int)join[i];
    argv = to_vector(argv_obj, "argv must be a sequence");
    if (argv == NULL)
        goto done;
    if (argv[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "argv must not be empty");
        goto done;
    }
    envp = to_vector(env_obj, "env must be a sequence");
    if (envp == NULL)
        goto done;

    sigset_t all, old_mask;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_mask);
    child_errno = 0;
    child_step = 0;
    pid_t parent = getpid();
    pid_t pid = vfork();
    if (pid == 0)
        child(argv, envp, PyBytes_AS_STRING(cwd_obj), limits, stdin_fd, out_fd, err_fd, no_network, join_fds,
              n_join, parent, &old_mask);
    int saved_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    if (pid < 0) {
        errno = saved_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (child_errno != 0) {
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
            ;
        PyObject *text = PyUnicode_FromFormat("%s: %s", step_names[child_step], strerror(child_errno));
        if (text != NULL) {
            PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iO", child_errno, text);
            if (exc != NULL) {
                PyErr_SetObject(PyExc_OSError, exc);
                Py_DECREF(exc);
            }
            Py_DECREF(text);
        }
        goto done;
    }
    result = PyLong_FromLong(pid);
done:
    free_vector(argv);
    free_vector(envp);
    Py_DECREF(cwd_obj);
    return result;
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "execpool._spawn", "vfork-based tool start for execpool workers.", -1, methods,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
