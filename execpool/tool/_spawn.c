/* Start one tool: vfork + everything that must happen before exec.
 *
 * Runs inside a worker (execpool/worker/spawn.py). A Python-level fork of the
 * worker costs milliseconds here -- the child copies page tables, takes
 * copy-on-write faults and tears the copy down again at exec -- while vfork
 * borrows the parent's memory until exec. subprocess uses vfork too, but it
 * cannot set rlimits or the parent-death signal in the child, and applying
 * them after exec leaves a window in which the tool (or a child it forks)
 * runs unlimited. So this does what glibc's posix_spawn does, plus those two:
 * new session, PR_SET_PDEATHSIG, working directory, stdin/stdout/stderr,
 * every other descriptor closed, rlimits, then execve -- and, for a
 * sandboxed job, between the descriptors and close_range: no new
 * privileges, no capabilities, the job's Landlock rulesets (built by the
 * worker, execpool/sandbox/rulesets.py) and the seccomp filter. Only
 * async-signal-safe calls run in the child; every allocation happens in the
 * parent before vfork; the child reports a failure through memory it shares
 * with the parent until exec.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436 /* the same number on every architecture */
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446 /* the same number on every architecture */
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

static const int limit_resources[] = {RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE};
#define N_LIMITS 4
#define MAX_JOIN_FDS 8

static const char *const step_names[] = {
    "setsid", "prctl(PR_SET_PDEATHSIG)", "setrlimit", "chdir", "dup2", "execve", "unshare(CLONE_NEWNET)",
    "joining the job's cgroup", "close_range", "prctl(PR_SET_NO_NEW_PRIVS)", "dropping capabilities",
    "landlock_restrict_self", "prctl(PR_SET_SECCOMP)", "entering the sandbox's view (setns)",
    "unshare(CLONE_NEWNS)", "cloning a path into the view (open_tree)", "mounting the job's own paths",
    "entering the job's user namespace (setns)",
};

/* include/uapi/linux/landlock.h, spelled out: the build machine's headers
 * may predate the fields this uses. */
struct ruleset_attr {
    unsigned long long handled_access_fs, handled_access_net, scoped;
};
struct path_beneath_attr {
    unsigned long long allowed_access;
    int parent_fd;
} __attribute__((packed));
struct net_port_attr {
    unsigned long long allowed_access, port;
};
#define SYS_landlock_create_ruleset_ 444
#define SYS_landlock_add_rule_ 445
#define LANDLOCK_RULE_PATH_BENEATH_ 1
#define LANDLOCK_RULE_NET_PORT_ 2

/* What a sandboxed tool's child needs, all prepared by the parent. */
#define MAX_RULESETS 4
#define MAX_STEPS 48
#define MAX_CLONES 16
/* The steps of a job's view (execpool/sandbox/view.py names them). */
#define STEP_CLONE_RW 1   /* open_tree(a): a path of the worker's, attached later by STEP_ATTACH */
#define STEP_CLONE_RO 2
#define STEP_TMPFS 3      /* an empty tmpfs on a, with the options b */
#define STEP_MKDIR 4      /* a, and what it lacks above it */
#define STEP_ATTACH 5     /* the clone numbered a on b */
#define STEP_UNCOVER 6    /* detach the mount on a: what the template hides, for a job that names it */
#define STEP_SAVE 7       /* open_tree(a), a reached without a link, in the job's namespace: attached again by STEP_ATTACH */
#define STEP_TOUCH 8      /* an empty file a, and the directories it lacks above it */
#define STEP_WRITE 9      /* b written to the file a before the namespace is entered: a copy's id maps */
#define STEP_SPACE 10     /* open_tree(the space, a): a directory of the job's space, attached later by STEP_ATTACH */
/* How a view's mount namespace is had: copied from the template (the
 * job's paths mounted in the copy), the job's own made ahead (entered as
 * it is), or a sandboxed session's copy's (entered, and its paths mounted
 * there: execpool/worker/sessions/family.py). */
#define VIEW_COPIED 0
#define VIEW_OWN 1
#define VIEW_INTO 2
struct view_step {
    int op;
    const char *a, *b;
};
struct confinement {
    int n_rulesets; /* 0: no sandbox */
    int rulesets[MAX_RULESETS];
    struct sock_fprog filter;
    int has_view;
    int own_namespace; /* VIEW_COPIED, VIEW_OWN or VIEW_INTO */
    int user_fd; /* the view's user namespace; -1 where the worker holds CAP_SYS_ADMIN */
    int mnt_fd;  /* the view's mount namespace, built once per worker */
    int space_fd; /* the job's space (execpool/worker/space.py): its home, /tmp and /dev/shm; -1 for none */
    int job_user_fd; /* the job's own user namespace (execpool/worker/userns.py), entered last; -1 for none */
    const char *cwd;
    struct view_step steps[MAX_STEPS];
    int n_steps;
};

/* include/uapi/linux/mount.h and openat2.h, spelled out for older build headers. */
struct mount_attr_ {
    unsigned long long attr_set, attr_clr, propagation, userns_fd;
};
struct open_how_ {
    unsigned long long flags, mode, resolve;
};
#define SYS_mount_setattr_ 442 /* the same numbers on every architecture */
#define SYS_open_tree_ 428
#define SYS_move_mount_ 429
#define SYS_openat2_ 437
#define MOUNT_ATTR_RDONLY_ 0x1ULL
#define AT_RECURSIVE_ 0x8000
#define OPEN_TREE_CLONE_ 1
#define MOVE_MOUNT_F_EMPTY_PATH_ 0x4
#define MOVE_MOUNT_T_EMPTY_PATH_ 0x40
#define RESOLVE_NO_MAGICLINKS_ 0x02
#define RESOLVE_NO_SYMLINKS_ 0x04
#define UMOUNT_NOFOLLOW_ 0x8

/* An O_PATH descriptor of `path` reached without following any link: a
 * job can put a link where a path the worker resolved used to be, and
 * must not redirect what is mounted, or where. */
static int open_unlinked(const char *path) {
    struct open_how_ how = {O_PATH | O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_MAGICLINKS_};
    return (int)syscall(SYS_openat2_, AT_FDCWD, path, &how, sizeof how);
}

/* A copy of the tree at `path` (already open as `fd` when >= 0), detached,
 * its mounts private -- a copy that shared the host's propagation would
 * send the job's mounts back to the host -- and read-only if asked. */
static int clone_tree(int fd, const char *path, int read_only) {
    int tree = fd >= 0 ? (int)syscall(SYS_open_tree_, fd, "", AT_EMPTY_PATH | OPEN_TREE_CLONE_ | O_CLOEXEC | AT_RECURSIVE_)
                       : (int)syscall(SYS_open_tree_, AT_FDCWD, path, OPEN_TREE_CLONE_ | O_CLOEXEC | AT_RECURSIVE_);
    if (tree < 0)
        return -1;
    struct mount_attr_ attr = {read_only ? MOUNT_ATTR_RDONLY_ : 0, 0, MS_PRIVATE, 0};
    if (syscall(SYS_mount_setattr_, tree, "", AT_EMPTY_PATH | AT_RECURSIVE_, &attr, sizeof attr) < 0) {
        close(tree);
        return -1;
    }
    return tree;
}

/* mkdir -p, in place: `path` is the child's copy; the last component a
 * directory too unless `file`, then an empty file. */
static int make_path(char *path, int file) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        int failed = mkdir(path, 0755) < 0 && errno != EEXIST;
        *p = '/';
        if (failed)
            return -1;
    }
    if (!file)
        return mkdir(path, 0755) < 0 && errno != EEXIST ? -1 : 0;
    int fd = open(path, O_CREAT | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    close(fd);
    return 0;
}

/* `text` written to the file `path`, which must exist: an id map. */
static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t length = (ssize_t)strlen(text);
    int failed = write(fd, text, (size_t)length) != length;
    int saved = errno;
    close(fd);
    errno = saved;
    return failed ? -1 : 0;
}

/* The job's view (execpool/sandbox/view.py): the paths of the worker's it
 * names cloned while the worker's mounts are still in reach (in the view's
 * user namespace first, where the worker lacks CAP_SYS_ADMIN), then the
 * view's mount namespace entered and copied -- a namespace of the tool's
 * own -- and the job's own paths mounted in it; then the working
 * directory, inside the view. Returns the failing step, or -1. */
static int make_view(const struct confinement *c) {
    int clones[MAX_CLONES], n_clones = 0, in_user = 0, step = -1;
    char path[PATH_MAX];
    if (c->own_namespace == VIEW_OWN) {
        if ((c->user_fd >= 0 && setns(c->user_fd, CLONE_NEWUSER) < 0) || setns(c->mnt_fd, CLONE_NEWNS) < 0)
            return 13;
        if (chdir(c->cwd) < 0)
            return 3;
        return c->job_user_fd >= 0 && setns(c->job_user_fd, CLONE_NEWUSER) < 0 ? 17 : -1;
    }
    for (int i = 0; i < c->n_steps; i++) {
        const struct view_step *s = &c->steps[i];
        if (s->op != STEP_WRITE && s->op != STEP_CLONE_RW && s->op != STEP_CLONE_RO)
            continue;
        if (c->user_fd >= 0 && !in_user) {
            /* Its own copy of the worker's mounts, owned by the view's
             * user namespace, where open_tree may clone them; and the
             * namespace a copy's id maps are written from (its parent's). */
            if (setns(c->user_fd, CLONE_NEWUSER) < 0)
                return 13;
            if (unshare(CLONE_NEWNS) < 0)
                return 14;
            in_user = 1;
        }
        if (s->op == STEP_WRITE) {
            if (write_file(s->a, s->b) < 0) {
                step = 16;
                goto done;
            }
            continue;
        }
        int fd = open_unlinked(s->a);
        int tree = fd < 0 ? -1 : clone_tree(fd, NULL, s->op == STEP_CLONE_RO);
        if (fd >= 0)
            close(fd);
        if (tree < 0) {
            step = 15;
            goto done;
        }
        clones[n_clones++] = tree;
    }
    if ((c->user_fd >= 0 && !in_user && setns(c->user_fd, CLONE_NEWUSER) < 0) || setns(c->mnt_fd, CLONE_NEWNS) < 0) {
        step = 13;
        goto done;
    }
    if (c->own_namespace != VIEW_INTO && unshare(CLONE_NEWNS) < 0) {
        step = 14;
        goto done;
    }
    step = 16;
    for (int i = 0; i < c->n_steps; i++) {
        const struct view_step *s = &c->steps[i];
        int failed = 0;
        switch (s->op) {
        case STEP_TMPFS:
            failed = mount("tmpfs", s->a, "tmpfs", MS_NOSUID | MS_NODEV, s->b) < 0;
            break;
        case STEP_SPACE: {
            /* Cloned here, in the job's namespace, where this process may
             * clone a mount (in the view's user namespace where the worker
             * lacks CAP_SYS_ADMIN); the space is new, so nothing in it is a
             * link, and none is followed anyway. */
            int tree = n_clones < MAX_CLONES ? (int)syscall(SYS_open_tree_, c->space_fd, s->a,
                                                            OPEN_TREE_CLONE_ | O_CLOEXEC | AT_SYMLINK_NOFOLLOW)
                                             : -1;
            failed = tree < 0;
            if (!failed)
                clones[n_clones++] = tree;
            break;
        }
        case STEP_MKDIR:
        case STEP_TOUCH:
            if (strlen(s->a) >= sizeof path) {
                errno = ENAMETOOLONG;
                goto done;
            }
            strcpy(path, s->a);
            failed = make_path(path, s->op == STEP_TOUCH) < 0;
            break;
        case STEP_UNCOVER:
            failed = umount2(s->a, MNT_DETACH | UMOUNT_NOFOLLOW_) < 0;
            break;
        case STEP_SAVE: {
            /* Reached without following a link: in a session's copy's
             * namespace (VIEW_INTO) its parent may have put one there. */
            int fd = n_clones < MAX_CLONES ? open_unlinked(s->a) : -1;
            int tree = fd < 0 ? -1 : clone_tree(fd, NULL, 0);
            if (fd >= 0) {
                int saved = errno;
                close(fd);
                errno = saved;
            }
            failed = tree < 0;
            if (!failed)
                clones[n_clones++] = tree;
            break;
        }
        case STEP_ATTACH: {
            int n = atoi(s->a), target = open_unlinked(s->b);
            if (n < 0 || n >= n_clones) {
                errno = EINVAL;
                failed = 1;
            } else {
                failed = target < 0 || syscall(SYS_move_mount_, clones[n], "", target, "",
                                               MOVE_MOUNT_F_EMPTY_PATH_ | MOVE_MOUNT_T_EMPTY_PATH_) < 0;
            }
            if (target >= 0) {
                int saved = errno;
                close(target);
                errno = saved;
            }
            break;
        }
        default:
            break;
        }
        if (failed)
            goto done;
    }
    if (chdir(c->cwd) < 0)
        step = 3;
    else
        /* Last: a user namespace of the job's own, which names every process
         * it will ever have (no process leaves its user namespace's subtree),
         * and whose owner may no longer mount. */
        step = c->job_user_fd >= 0 && setns(c->job_user_fd, CLONE_NEWUSER) < 0 ? 17 : -1;
done:
    for (int i = 0; i < n_clones; i++) {
        int saved = errno;
        close(clones[i]);
        errno = saved;
    }
    return step;
}

/* The read-only view, no new privileges, no capabilities (a root tool
 * keeps its uid and loses every capability, so nothing it execs gains one
 * either), the Landlock layers in order, the seccomp filter:
 * execpool/shared/kernel/sandbox.py says why each. Returns the failing step, or -1. */
static int confine(const struct confinement *c) {
    int step;
    if (c->has_view && (step = make_view(c)) >= 0)
        return step;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return 9;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); /* EINVAL before 4.3: none to clear */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0)
        return 10;
    for (int i = 0; i < c->n_rulesets; i++)
        if (syscall(SYS_landlock_restrict_self, c->rulesets[i], 0U) < 0)
            return 11;
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &c->filter, 0, 0) < 0)
        return 12;
    return -1;
}

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
                  const sigset_t *old_mask, const struct confinement *confinement) {
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
    /* While the rulesets' descriptors are still open; before the rlimits,
     * which a root tool could otherwise raise again, and before anything
     * of the tool runs. */
    if (confinement->n_rulesets > 0 && (step = confine(confinement)) >= 0)
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
"spawn(argv, env, cwd, limits, stdin_fd, out_fd, err_fd, no_network, join_fds, sandbox) -> pid\n\n"
"Start argv[0] (an absolute path) in a new session with env (a list of\n"
"'KEY=value'), the parent-death signal SIGKILL, the rlimits (address space,\n"
"CPU seconds, file size, open files; -1 leaves one unchanged) applied as\n"
"both soft and hard limits, cwd as working directory, stdin from stdin_fd,\n"
"stdout on out_fd and stderr on err_fd (the same pipe to merge them), in a\n"
"network namespace of its own (only a loopback that is down) when\n"
"no_network is true, after writing \"0\" to each of join_fds (open\n"
"cgroup.procs files), and, unless sandbox is None, confined by it: a tuple\n"
"(ruleset_fds, seccomp_filter_bytes, view) from\n"
"execpool.shared.kernel.sandbox.child_arguments. Raises OSError naming the step that failed.");

/* Fill the view of *c from None or (user_fd, mnt_fd, space_fd, job_user_fd,
 * steps, cwd, own_namespace): steps a tuple of (op, a, b), a and b bytes;
 * pointers into `view`, which the caller keeps alive. */
static int parse_view(PyObject *view, struct confinement *c) {
    PyObject *steps;
    if (view == Py_None)
        return 0;
    if (!PyArg_ParseTuple(view, "iiiiOyi", &c->user_fd, &c->mnt_fd, &c->space_fd, &c->job_user_fd, &steps,
                          &c->cwd, &c->own_namespace))
        return -1;
    if (c->own_namespace < VIEW_COPIED || c->own_namespace > VIEW_INTO) {
        PyErr_Format(PyExc_ValueError, "not a way to have a view's namespace: %d", c->own_namespace);
        return -1;
    }
    if (!PyTuple_Check(steps) || PyTuple_GET_SIZE(steps) > MAX_STEPS) {
        PyErr_Format(PyExc_ValueError, "the view's steps: a tuple of at most %d", MAX_STEPS);
        return -1;
    }
    int clones = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(steps); i++) {
        struct view_step *s = &c->steps[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(steps, i), "iyy", &s->op, &s->a, &s->b))
            return -1;
        if (s->op < STEP_CLONE_RW || s->op > STEP_SPACE) {
            PyErr_Format(PyExc_ValueError, "not a step of a view: %d", s->op);
            return -1;
        }
        if ((s->op == STEP_CLONE_RW || s->op == STEP_CLONE_RO || s->op == STEP_SAVE || s->op == STEP_SPACE) &&
            ++clones > MAX_CLONES) {
            PyErr_Format(PyExc_ValueError, "a view clones at most %d paths", MAX_CLONES);
            return -1;
        }
    }
    c->n_steps = (int)PyTuple_GET_SIZE(steps);
    c->has_view = 1;
    return 0;
}

/* Fill *c from (ruleset_fds, seccomp_filter_bytes, view): at least one ruleset, and a filter; 0, or -1 with an exception set. */
static int parse_confinement(PyObject *args, struct confinement *c) {
    PyObject *fds, *view;
    const char *filter;
    Py_ssize_t filter_size;
    if (!PyArg_ParseTuple(args, "Oy#O", &fds, &filter, &filter_size, &view) ||
        parse_view(view, c) < 0)
        return -1;
    PyObject *fast = PySequence_Fast(fds, "the sandbox's rulesets must be a sequence of descriptors");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < (c->own_namespace == VIEW_INTO ? 0 : 1) || n > MAX_RULESETS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "the sandbox needs 1 to %d rulesets, not %zd", MAX_RULESETS, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (fd < 0 || fd > INT_MAX) {
            Py_DECREF(fast);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a ruleset descriptor must be a descriptor");
            return -1;
        }
        c->rulesets[i] = (int)fd;
    }
    Py_DECREF(fast);
    c->n_rulesets = (int)n;
    if (filter_size <= 0 || filter_size % sizeof(struct sock_filter) != 0 ||
        filter_size / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        PyErr_SetString(PyExc_ValueError, "the sandbox needs a seccomp filter");
        return -1;
    }
    c->filter.len = (unsigned short)(filter_size / sizeof(struct sock_filter));
    c->filter.filter = (struct sock_filter *)filter;
    return 0;
}

static PyObject *spawn(PyObject *self, PyObject *args) {
    PyObject *argv_obj, *env_obj, *cwd_obj, *limits_obj, *join_obj, *sandbox_obj = Py_None;
    int stdin_fd, out_fd, err_fd, no_network;
    if (!PyArg_ParseTuple(args, "OOO&OiiipO|O", &argv_obj, &env_obj, PyUnicode_FSConverter, &cwd_obj,
                          &limits_obj, &stdin_fd, &out_fd, &err_fd, &no_network, &join_obj, &sandbox_obj))
        return NULL;
    struct confinement confinement;
    memset(&confinement, 0, sizeof confinement);
    /* The filter's bytes live in sandbox_obj, which outlives the vfork child. */
    if (sandbox_obj != Py_None && parse_confinement(sandbox_obj, &confinement) < 0) {
        Py_DECREF(cwd_obj);
        return NULL;
    }
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
              n_join, parent, &old_mask, &confinement);
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

PyDoc_STRVAR(ruleset_doc,
"ruleset(handled_fs, scoped, rules, handled_net=0, ports=()) -> fd\n\n"
"A new Landlock ruleset handling the filesystem rights handled_fs, the\n"
"network rights handled_net and the scopes scoped, with one path-beneath\n"
"rule per (O_PATH fd, rights) pair of rules and one port rule per\n"
"(port, rights) pair of ports: what execpool.sandbox.rulesets.Confiner builds for\n"
"each sandboxed job, in one call rather than one ctypes call per rule.\n"
"Raises OSError.");

/* Add one rule per pair of `pairs`, each (int, unsigned long long); 0 or
 * -1 with an exception set. */
static int add_rules(long fd, PyObject *pairs, int net) {
    PyObject *fast = PySequence_Fast(pairs, "rules must be a sequence of pairs");
    if (fast == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        int first;
        unsigned long long rights;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iK", &first, &rights)) {
            Py_DECREF(fast);
            return -1;
        }
        long done;
        if (net) {
            struct net_port_attr rule = {rights, (unsigned long long)first};
            done = syscall(SYS_landlock_add_rule_, (int)fd, LANDLOCK_RULE_NET_PORT_, &rule, 0U);
        } else {
            struct path_beneath_attr rule = {rights, first};
            done = syscall(SYS_landlock_add_rule_, (int)fd, LANDLOCK_RULE_PATH_BENEATH_, &rule, 0U);
        }
        if (done < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *ruleset(PyObject *self, PyObject *args) {
    struct ruleset_attr attr = {0, 0, 0};
    PyObject *rules, *ports = NULL;
    if (!PyArg_ParseTuple(args, "KKO|KO", &attr.handled_access_fs, &attr.scoped, &rules, &attr.handled_access_net,
                          &ports))
        return NULL;
    long fd = syscall(SYS_landlock_create_ruleset_, &attr, sizeof attr, 0U);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (add_rules(fd, rules, 0) < 0 || (ports != NULL && add_rules(fd, ports, 1) < 0)) {
        close((int)fd);
        return NULL;
    }
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(confine_doc,
"confine(ruleset_fds, seccomp_filter_bytes, view)\n\n"
"Enter the sandbox in the calling process, as spawn's child does: what a\n"
"forked tool or a warm spare runs (execpool.shared.kernel.sandbox.enter does the same\n"
"through ctypes, a few hundred microseconds slower). Raises OSError.");

static PyObject *confine_self(PyObject *self, PyObject *args) {
    struct confinement confinement;
    memset(&confinement, 0, sizeof confinement);
    if (parse_confinement(args, &confinement) < 0)
        return NULL;
    int step = confine(&confinement);
    if (step >= 0) {
        int saved = errno;
        PyErr_Format(PyExc_OSError, "%s: %s", step_names[step], strerror(saved));
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Run `body(arg)` in a short-lived child that shares the caller's memory
 * and descriptors (CLONE_VM | CLONE_FILES) and runs alone until it exits
 * (CLONE_VFORK): a descriptor it opens is left here, and it may change
 * namespaces the caller never does. 0, or -1 with an exception set. */
static int in_child(int (*body)(void *), void *arg) {
    size_t stack_size = 1 << 16;
    char *stack = PyMem_Malloc(stack_size);
    if (stack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    sigset_t all, old_mask;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_mask);
    pid_t pid = clone(body, stack + stack_size, CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, arg);
    int saved = errno;
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    if (pid > 0) {
        int status;
        while (waitpid(pid, &status, __WALL) < 0 && errno == EINTR)
            ;
    }
    PyMem_Free(stack);
    if (pid < 0) {
        errno = saved;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

/* Shared with prepare_view's child, which shares the worker's memory and
 * descriptors until it exits. */
struct preparation {
    const struct confinement *c;
    int fd, step, error;
};

static int prepare_child(void *arg) {
    struct preparation *p = arg;
    p->step = make_view(p->c);
    if (p->step < 0) {
        p->fd = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
        if (p->fd < 0)
            p->step = 13;
    }
    p->error = errno;
    _exit(0);
}

PyDoc_STRVAR(prepare_view_doc,
"prepare_view(sandbox) -> fd\n\n"
"A job's mount namespace made ahead of the job: a short-lived child takes\n"
"the view's steps (sandbox as spawn takes it) and leaves a descriptor of\n"
"its namespace, the\n"
"caller's, which the job's tool enters (a view with own_namespace) instead\n"
"of copying the template and mounting its own paths then. With a view\n"
"that goes into a namespace (VIEW_INTO: a sandboxed session's copy's), the\n"
"steps are taken there and no ruleset is needed. Raises OSError naming\n"
"the step that failed.");

static PyObject *prepare_view(PyObject *self, PyObject *args) {
    PyObject *sandbox;
    struct confinement confinement;
    memset(&confinement, 0, sizeof confinement);
    if (!PyArg_ParseTuple(args, "O", &sandbox) || parse_confinement(sandbox, &confinement) < 0)
        return NULL;
    if (!confinement.has_view || confinement.own_namespace == VIEW_OWN) {
        PyErr_SetString(PyExc_ValueError, "prepare_view needs a view's steps");
        return NULL;
    }
    struct preparation p = {&confinement, -1, -1, 0};
    if (in_child(prepare_child, &p) < 0)
        return NULL;
    if (p.step >= 0) {
        if (p.fd >= 0)
            close(p.fd);
        PyErr_Format(PyExc_OSError, "%s: %s", step_names[p.step], strerror(p.error));
        return NULL;
    }
    return PyLong_FromLong(p.fd);
}

/* include/uapi/linux/mount.h, spelled out for older build headers. */
#define SYS_fsopen_ 430 /* the same numbers on every architecture */
#define SYS_fsconfig_ 431
#define SYS_fsmount_ 432
#define FSOPEN_CLOEXEC_ 0x1
#define FSCONFIG_SET_STRING_ 1
#define FSCONFIG_CMD_CREATE_ 6
#define FSMOUNT_CLOEXEC_ 0x1
#define MOUNT_ATTR_NOSUID_ 0x2
#define MOUNT_ATTR_NODEV_ 0x4

/* A detached tmpfs bounded to `size` bytes and `inodes` files, no setuid
 * files or devices in it: a job's space. -1 with errno set. */
static int new_space(const char *size, const char *inodes) {
    int fs = (int)syscall(SYS_fsopen_, "tmpfs", FSOPEN_CLOEXEC_);
    if (fs < 0)
        return -1;
    int mnt = -1;
    if (syscall(SYS_fsconfig_, fs, FSCONFIG_SET_STRING_, "size", size, 0) == 0 &&
        syscall(SYS_fsconfig_, fs, FSCONFIG_SET_STRING_, "nr_inodes", inodes, 0) == 0 &&
        syscall(SYS_fsconfig_, fs, FSCONFIG_SET_STRING_, "mode", "0700", 0) == 0 &&
        syscall(SYS_fsconfig_, fs, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) == 0)
        mnt = (int)syscall(SYS_fsmount_, fs, FSMOUNT_CLOEXEC_, MOUNT_ATTR_NOSUID_ | MOUNT_ATTR_NODEV_);
    int saved = errno;
    close(fs);
    errno = saved;
    return mnt;
}

/* Shared with space's child, which shares the caller's memory and
 * descriptors until it exits. */
struct space_request {
    const char *size, *inodes;
    int user_fd, mnt_fd, fd, error;
};

static int space_child(void *arg) {
    struct space_request *r = arg;
    if (setns(r->user_fd, CLONE_NEWUSER) < 0 || setns(r->mnt_fd, CLONE_NEWNS) < 0)
        r->fd = -1;
    else
        r->fd = new_space(r->size, r->inodes);
    r->error = errno;
    _exit(0);
}

PyDoc_STRVAR(space_doc,
"space(size, inodes, user_fd, mnt_fd) -> fd\n\n"
"A new, detached tmpfs of at most size bytes and inodes files (both\n"
"bytes, in decimal), mode 0700, nosuid and nodev: the descriptor of its\n"
"mount, the caller's (execpool/worker/space.py). Made in the calling\n"
"process where user_fd is -1 (it holds CAP_SYS_ADMIN); else by a\n"
"short-lived child in the user namespace user_fd and the mount namespace\n"
"mnt_fd (a view's template's, where the caller may not mount), which\n"
"leaves the descriptor here. Raises OSError.");

static PyObject *space(PyObject *self, PyObject *args) {
    struct space_request r = {NULL, NULL, -1, -1, -1, 0};
    if (!PyArg_ParseTuple(args, "yyii", &r.size, &r.inodes, &r.user_fd, &r.mnt_fd))
        return NULL;
    if (r.user_fd < 0) {
        int fd = new_space(r.size, r.inodes);
        return fd < 0 ? PyErr_SetFromErrno(PyExc_OSError) : PyLong_FromLong(fd);
    }
    if (in_child(space_child, &r) < 0)
        return NULL;
    if (r.fd < 0) {
        errno = r.error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(r.fd);
}

/* Shared with user_namespace's child, which shares the caller's memory
 * and descriptors until it exits. */
struct userns_request {
    int parent_fd, fd, error;
    const char *uid_map, *gid_map;
};

static int userns_child(void *arg) {
    struct userns_request *r = arg;
    r->fd = -1;
    if ((r->parent_fd < 0 || setns(r->parent_fd, CLONE_NEWUSER) == 0) && unshare(CLONE_NEWUSER) == 0 &&
        write_file("/proc/self/setgroups", "deny") == 0 && write_file("/proc/self/uid_map", r->uid_map) == 0 &&
        write_file("/proc/self/gid_map", r->gid_map) == 0)
        r->fd = open("/proc/self/ns/user", O_RDONLY | O_CLOEXEC);
    r->error = errno;
    _exit(0);
}

PyDoc_STRVAR(user_namespace_doc,
"user_namespace(parent_fd, uid_map, gid_map) -> fd\n\n"
"A new user namespace, a child of the user namespace parent_fd (-1: the\n"
"caller's), its ids mapped as uid_map and gid_map say (bytes, as\n"
"/proc/<pid>/uid_map takes them) and setgroups denied: the descriptor of\n"
"it, the caller's, which a job's tool enters last (execpool/worker/\n"
"userns.py). Made by a short-lived child that leaves the descriptor here.\n"
"Raises OSError.");

static PyObject *user_namespace(PyObject *self, PyObject *args) {
    struct userns_request r = {-1, -1, 0, NULL, NULL};
    if (!PyArg_ParseTuple(args, "iyy", &r.parent_fd, &r.uid_map, &r.gid_map))
        return NULL;
    if (in_child(userns_child, &r) < 0)
        return NULL;
    if (r.fd < 0) {
        errno = r.error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(r.fd);
}

static PyMethodDef methods[] = {
    {"confine", confine_self, METH_VARARGS, confine_doc},
    {"prepare_view", prepare_view, METH_VARARGS, prepare_view_doc},
    {"space", space, METH_VARARGS, space_doc},
    {"user_namespace", user_namespace, METH_VARARGS, user_namespace_doc},
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {"ruleset", ruleset, METH_VARARGS, ruleset_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "execpool.tool._spawn", "vfork-based tool start for execpool workers.", -1, methods,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
