/*
 * slowfs: a slow, faulty, read-only FUSE mirror of a directory, for safeload's tests and benchmark.
 *
 *   slowfs SRC MOUNTPOINT [options]        (stays in the foreground; fusermount3 -u MOUNTPOINT ends it)
 *
 * Built and mounted by tests/support/slowfs.py (`mounted()`), which is what tests and
 * `python benches/bench.py --slow-fs` use. libfuse3, high-level API, multi-threaded loop with up
 * to --threads (256) workers that are never reaped, so the daemon is never the limit: every read
 * request gets its own thread, sleeps without holding a lock, then preads the backing file.
 *
 * Faults and delays (per FUSE READ request; the kernel decides how big the requests are):
 *   --latency SECONDS        every read request is answered SECONDS late.
 *   --bandwidth BYTES_PER_S  one link shared by all requests (a token bucket without burst): after
 *                            its latency a request waits for its size / BYTES_PER_S turn on it.
 *   --eio NAME:OFFSET        a read request of file NAME (path relative to SRC) whose requested
 *                            range [offset, offset + size) covers OFFSET fails with EIO. Repeatable.
 *   --short-reads            a request of more than 4096 bytes gets half of what it could get (the
 *                            kernel takes a short answer for end of file).
 *   --shrink NAME:SIZE:AFTER once AFTER bytes of NAME have been served, NAME reports (getattr) and
 *                            serves at most SIZE bytes: a file truncated under the reader.
 *   --zero-cut NAME:SIZE:AFTER
 *                            a truncation that a reader sees as zeros, not as end of file: once
 *                            AFTER bytes of NAME have been served, the first read request reaching
 *                            past SIZE cuts NAME to SIZE. That request, and every one after it
 *                            until the kernel next asks NAME's attributes (getattr, which reports
 *                            SIZE from the cut on), is answered in full (the length asked for, as
 *                            far as the real file goes) with its bytes at and beyond SIZE zeroed;
 *                            from that getattr on NAME serves at most SIZE bytes, as --shrink.
 *                            This is what a read racing a truncate on Linux returns: the size is
 *                            lowered first, then the cut-off part of the page straddling the new
 *                            end is zeroed in place, and a read that sampled the old size and holds
 *                            that page copies the zeros and returns full length. With --direct-io
 *                            the kernel asks no attributes while it reads, so the read(2) that
 *                            reaches SIZE first returns full length, zeros past SIZE, whatever
 *                            requests it is split into; with --attr-timeout 0 an fstat or
 *                            lseek(SEEK_END) after it reaches getattr and sees SIZE.
 *   --hold-after BYTES       once BYTES have been served (all files), every further read request
 *                            waits until the test lets it go: a read of the hidden file
 *                            /.slowfs-release lets the requests waiting then go on (later ones
 *                            wait again), one of /.slowfs-release-all ends the holding. A reader
 *                            is then provably in the middle of its reads, whatever the timing.
 * Kernel-facing knobs (negotiated in INIT; see /sys/fs/fuse/connections/N/ for a live mount):
 *   --max-background N       conn->max_background: how many asynchronous requests the kernel keeps
 *                            in flight on the connection (buffered readahead, and O_DIRECT reads
 *                            split by async DIO). Kernel default 12, which at 2 ms a request of
 *                            128 KiB caps *all* buffered readers together near 0.6 GiB/s.
 *   --congestion-threshold N conn->congestion_threshold (default 3/4 of max_background): above
 *                            it the kernel tells the writeback/readahead code the bdi is congested.
 *   --max-read BYTES         the `max_read` mount option and conn->max_read: the largest READ
 *                            request the kernel sends (buffered and direct). Default: unlimited.
 *   --max-pages N            conn->max_write = N pages, from which libfuse3 derives max_pages: the
 *                            largest request in pages (libfuse3 default and maximum 256 = 1 MiB;
 *                            the kernel's own default without FUSE_MAX_PAGES is 32 = 128 KiB).
 *   --max-readahead BYTES    conn->max_readahead: can only lower the bdi's readahead window
 *                            (read_ahead_kb, 128 KiB by default; root can raise it in
 *                            /sys/class/bdi/0:N/read_ahead_kb).
 *   --no-async-dio           clear FUSE_CAP_ASYNC_DIO: an O_DIRECT read is then sent as one
 *                            request after the other instead of all its pieces at once.
 *   --no-direct              open(O_DIRECT) fails with EINVAL, as on many network filesystems.
 *                            Without it the kernel serves O_DIRECT through fuse_direct_IO: the
 *                            read bypasses the page cache and is split into max_pages requests.
 *   --direct-io              FOPEN_DIRECT_IO on every open: no page cache at all, every read(2)
 *                            goes to the daemon as is (split at max_read/max_pages). Off by default.
 *   --keep-cache             FOPEN_KEEP_CACHE: keep the file's page cache across opens (default:
 *                            the kernel drops it on every open, so a fresh open reads cold).
 *   --attr-timeout SECONDS   how long the kernel caches attributes, the size among them (libfuse's
 *                            attr_timeout, default 1): 0 makes every fstat, lseek(SEEK_END) and
 *                            (buffered) read ask getattr, so a size change shows at once.
 *   --threads N              most worker threads (256); --clone-fd: one /dev/fuse fd per worker.
 *   --fsname NAME            the mount's source name in /proc/mounts (default slowfs); `hf-mount`
 *                            makes it what transformers takes for an hf-mount FUSE mount.
 *   --debug                  libfuse's debug log on stderr.
 *
 * A hidden file /.slowfs-stats (not listed by readdir) reads as one line of counters,
 * "reads=N bytes=N inflight_max=N size_max=N size_min=N errors=N held=N zeroed=N", and reading it
 * resets the three peaks (inflight_max, size_max, size_min); held is how many requests --hold-after
 * holds now, zeroed how many --zero-cut answered with zeros. At exit the same line is printed on
 * stderr.
 */
#define _GNU_SOURCE
#ifndef FUSE_USE_VERSION
#define FUSE_USE_VERSION 312
#endif
#include <fuse.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define STATS_PATH "/.slowfs-stats"
#define RELEASE_PATH "/.slowfs-release"
#define RELEASE_ALL_PATH "/.slowfs-release-all"
/* File handles of the hidden files. */
#define FH_STATS ((uint64_t)-1)
#define FH_RELEASE ((uint64_t)-2)
#define FH_RELEASE_ALL ((uint64_t)-3)
#define MAX_SPECS 64

struct eio_spec { char *name; long long offset; };
/* --shrink, and --zero-cut (zero set): `cut` once a request reached past SIZE, `asked` once
 * getattr reported the cut. */
struct shrink_spec { char *name; long long size, after; int zero; unsigned long long served; int cut, asked; };

static struct {
	char root[PATH_MAX];
	double latency, bandwidth;
	struct eio_spec eio[MAX_SPECS]; int n_eio;
	struct shrink_spec shrink[MAX_SPECS]; int n_shrink;
	int short_reads, no_direct, direct_io, keep_cache, no_async_dio, clone_fd, debug;
	long long max_background, congestion_threshold, max_read, max_pages, max_readahead;
	int threads;
	const char *fsname;
	long long hold_after;  /* -1: never hold */
	double attr_timeout;   /* -1: libfuse's default */
} opt = { .fsname = "slowfs",  .max_background = -1, .congestion_threshold = -1, .max_pages = -1, .max_readahead = -1,
          .threads = 256, .hold_after = -1, .attr_timeout = -1 };

/* --hold-after: requests wait for the round they arrived in to end (a read of RELEASE_PATH). */
static pthread_mutex_t hold_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static unsigned long long hold_round, held;
static int hold_off;

static struct {
	unsigned long long reads, bytes, errors, inflight, inflight_max, size_max, size_min, zeroed;
} stats = { .size_min = ULLONG_MAX };

static pthread_mutex_t link_lock = PTHREAD_MUTEX_INITIALIZER;
static double link_free_at;  /* CLOCK_MONOTONIC seconds at which the shared link is free */

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_until(double t)
{
	struct timespec ts = { .tv_sec = (time_t)t, .tv_nsec = (long)((t - (time_t)t) * 1e9) };
	if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

static void peak(unsigned long long *slot, unsigned long long v, int want_max)
{
	unsigned long long cur = __atomic_load_n(slot, __ATOMIC_RELAXED);
	while (want_max ? v > cur : v < cur)
		if (__atomic_compare_exchange_n(slot, &cur, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
			break;
}

static int stats_line(char *buf, size_t n, int reset)
{
	unsigned long long im = __atomic_load_n(&stats.inflight_max, __ATOMIC_RELAXED);
	unsigned long long sm = __atomic_load_n(&stats.size_max, __ATOMIC_RELAXED);
	unsigned long long sn = __atomic_load_n(&stats.size_min, __ATOMIC_RELAXED);
	pthread_mutex_lock(&hold_lock);
	unsigned long long h = held;
	pthread_mutex_unlock(&hold_lock);
	int len = snprintf(buf, n, "reads=%llu bytes=%llu inflight_max=%llu size_max=%llu size_min=%llu errors=%llu held=%llu "
	                   "zeroed=%llu\n",
	                   __atomic_load_n(&stats.reads, __ATOMIC_RELAXED), __atomic_load_n(&stats.bytes, __ATOMIC_RELAXED),
	                   im, sm, sn == ULLONG_MAX ? 0ULL : sn, __atomic_load_n(&stats.errors, __ATOMIC_RELAXED), h,
	                   __atomic_load_n(&stats.zeroed, __ATOMIC_RELAXED));
	if (reset) {
		__atomic_store_n(&stats.inflight_max, __atomic_load_n(&stats.inflight, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
		__atomic_store_n(&stats.size_max, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&stats.size_min, ULLONG_MAX, __ATOMIC_RELAXED);
	}
	return len;
}

static int full_path(char *out, const char *path)
{
	if (snprintf(out, PATH_MAX, "%s%s", opt.root, path) >= PATH_MAX)
		return -ENAMETOOLONG;
	return 0;
}

static struct shrink_spec *shrink_of(const char *name)
{
	for (int i = 0; i < opt.n_shrink; i++)
		if (strcmp(opt.shrink[i].name, name) == 0)
			return &opt.shrink[i];
	return NULL;
}

static int served_after(const struct shrink_spec *s)
{
	return __atomic_load_n(&s->served, __ATOMIC_RELAXED) >= (unsigned long long)s->after;
}

/* Whether spec S has cut its file (of REAL bytes) to SIZE: --shrink once AFTER bytes of it were
 * served, --zero-cut once a request reached past SIZE after that. */
static int is_cut(const struct shrink_spec *s, long long real)
{
	if (!s || s->size >= real)
		return 0;
	return s->zero ? __atomic_load_n(&s->cut, __ATOMIC_RELAXED) : served_after(s);
}

/* The size getattr reports for NAME: its real size, or at most SIZE once it is cut (from then
 * on a --zero-cut file serves at most SIZE bytes too). */
static long long reported_size(const char *name, long long real)
{
	struct shrink_spec *s = shrink_of(name);
	if (!is_cut(s, real))
		return real;
	__atomic_store_n(&s->asked, 1, __ATOMIC_RELAXED);
	return s->size;
}

static void *sf_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
	if (opt.attr_timeout >= 0) cfg->attr_timeout = opt.attr_timeout;
	if (opt.max_background >= 0) conn->max_background = (unsigned)opt.max_background;
	if (opt.congestion_threshold >= 0) conn->congestion_threshold = (unsigned)opt.congestion_threshold;
	if (opt.max_read > 0) conn->max_read = (unsigned)opt.max_read;  /* must equal the mount option */
	if (opt.max_pages > 0) conn->max_write = (unsigned)(opt.max_pages * sysconf(_SC_PAGESIZE));
	if (opt.max_readahead >= 0) conn->max_readahead = (unsigned)opt.max_readahead;
	if (opt.no_async_dio) conn->want &= ~FUSE_CAP_ASYNC_DIO;
	fprintf(stderr, "slowfs: init: max_background=%u congestion_threshold=%u max_read=%u max_write=%u "
	        "max_readahead=%u async_dio=%d\n", conn->max_background, conn->congestion_threshold, conn->max_read,
	        conn->max_write, conn->max_readahead, !!(conn->want & FUSE_CAP_ASYNC_DIO));
	return NULL;
}

static int sf_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
	(void)fi;
	char full[PATH_MAX];
	if (strcmp(path, STATS_PATH) == 0 || strcmp(path, RELEASE_PATH) == 0 || strcmp(path, RELEASE_ALL_PATH) == 0) {
		memset(st, 0, sizeof *st);
		st->st_mode = S_IFREG | 0444;
		st->st_nlink = 1;
		return 0;
	}
	int r = full_path(full, path);
	if (r) return r;
	if (lstat(full, st) < 0) return -errno;
	if (S_ISREG(st->st_mode)) {
		st->st_mode = S_IFREG | 0444;
		st->st_size = reported_size(path + 1, st->st_size);
	}
	return 0;
}

static int sf_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
                      struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	(void)offset; (void)fi; (void)flags;
	char full[PATH_MAX];
	int r = full_path(full, path);
	if (r) return r;
	DIR *d = opendir(full);
	if (!d) return -errno;
	struct dirent *e;
	while ((e = readdir(d)) != NULL)
		if (filler(buf, e->d_name, NULL, 0, 0))
			break;
	closedir(d);
	return 0;
}

static int sf_open(const char *path, struct fuse_file_info *fi)
{
	if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
	uint64_t hidden = strcmp(path, STATS_PATH) == 0 ? FH_STATS
	                : strcmp(path, RELEASE_PATH) == 0 ? FH_RELEASE
	                : strcmp(path, RELEASE_ALL_PATH) == 0 ? FH_RELEASE_ALL : 0;
	if (hidden) {
		fi->fh = hidden;
		fi->direct_io = 1;
		return 0;
	}
	if (opt.no_direct && (fi->flags & O_DIRECT)) return -EINVAL;
	char full[PATH_MAX];
	int r = full_path(full, path);
	if (r) return r;
	int fd = open(full, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return -errno;
	fi->fh = (uint64_t)fd;
	fi->direct_io = opt.direct_io;
	fi->keep_cache = opt.keep_cache;
	return 0;
}

static int sf_read(const char *path, char *buf, size_t size, off_t offset, struct fuse_file_info *fi)
{
	if (fi->fh == FH_RELEASE || fi->fh == FH_RELEASE_ALL) {  /* let held requests go */
		if (offset > 0) return 0;
		pthread_mutex_lock(&hold_lock);
		hold_round++;
		if (fi->fh == FH_RELEASE_ALL) hold_off = 1;
		pthread_cond_broadcast(&hold_cv);
		pthread_mutex_unlock(&hold_lock);
		memcpy(buf, "ok\n", size < 3 ? size : 3);
		return size < 3 ? (int)size : 3;
	}
	if (fi->fh == FH_STATS) {  /* the stats file */
		char line[512];
		int len = stats_line(line, sizeof line, offset == 0);
		if (offset >= len) return 0;
		size_t n = (size_t)(len - offset) < size ? (size_t)(len - offset) : size;
		memcpy(buf, line + offset, n);
		return (int)n;
	}
	unsigned long long in = __atomic_add_fetch(&stats.inflight, 1, __ATOMIC_RELAXED);
	__atomic_add_fetch(&stats.reads, 1, __ATOMIC_RELAXED);
	peak(&stats.inflight_max, in, 1);
	peak(&stats.size_max, size, 1);
	peak(&stats.size_min, size, 0);
	int res = 0;
	const char *name = path + 1;

	if (opt.hold_after >= 0 && __atomic_load_n(&stats.bytes, __ATOMIC_RELAXED) >= (unsigned long long)opt.hold_after) {
		pthread_mutex_lock(&hold_lock);
		unsigned long long mine = hold_round;
		held++;
		while (!hold_off && hold_round == mine)
			pthread_cond_wait(&hold_cv, &hold_lock);
		held--;
		pthread_mutex_unlock(&hold_lock);
	}

	double t = now() + opt.latency;
	if (opt.bandwidth > 0) {
		pthread_mutex_lock(&link_lock);
		double start = link_free_at > t ? link_free_at : t;
		link_free_at = start + (double)size / opt.bandwidth;
		t = link_free_at;
		pthread_mutex_unlock(&link_lock);
	}
	if (opt.latency > 0 || opt.bandwidth > 0)
		sleep_until(t);

	for (int i = 0; i < opt.n_eio; i++)
		if (strcmp(opt.eio[i].name, name) == 0 && offset <= opt.eio[i].offset &&
		    opt.eio[i].offset < offset + (long long)size) {
			res = -EIO;
			goto out;
		}
	struct stat st;
	if (fstat((int)fi->fh, &st) < 0) { res = -errno; goto out; }
	struct shrink_spec *s = shrink_of(name);
	long long end = offset + (long long)size, limit = st.st_size, zero_from = LLONG_MAX;
	if (s && s->zero && end > s->size && served_after(s))
		__atomic_store_n(&s->cut, 1, __ATOMIC_RELAXED);
	if (is_cut(s, st.st_size)) {
		if (s->zero && !__atomic_load_n(&s->asked, __ATOMIC_RELAXED))
			zero_from = s->size;  /* --zero-cut, not reported yet: in full, zeros from SIZE */
		else
			limit = s->size;
	}
	if (end > limit) end = limit;
	if (end <= offset) goto out;
	if (opt.short_reads && end - offset > 4096)
		end = offset + (end - offset) / 2;
	size_t want = (size_t)(end - offset), got = 0;
	while (got < want) {
		ssize_t n = pread((int)fi->fh, buf + got, want - got, offset + (off_t)got);
		if (n < 0) {
			if (errno == EINTR) continue;
			res = -errno;
			goto out;
		}
		if (n == 0) break;
		got += (size_t)n;
	}
	if (zero_from < offset + (long long)got) {
		long long from = zero_from > offset ? zero_from - offset : 0;
		memset(buf + from, 0, got - (size_t)from);
		__atomic_add_fetch(&stats.zeroed, 1, __ATOMIC_RELAXED);
	}
	res = (int)got;
	if (s) __atomic_add_fetch(&s->served, got, __ATOMIC_RELAXED);
	__atomic_add_fetch(&stats.bytes, got, __ATOMIC_RELAXED);
out:
	if (res < 0) __atomic_add_fetch(&stats.errors, 1, __ATOMIC_RELAXED);
	__atomic_sub_fetch(&stats.inflight, 1, __ATOMIC_RELAXED);
	return res;
}

static int sf_release(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	if (fi->fh != FH_STATS && fi->fh != FH_RELEASE && fi->fh != FH_RELEASE_ALL) close((int)fi->fh);
	return 0;
}

static int sf_statfs(const char *path, struct statvfs *sv)
{
	(void)path;
	return statvfs(opt.root, sv) < 0 ? -errno : 0;
}

static const struct fuse_operations ops = {
	.init = sf_init,
	.getattr = sf_getattr,
	.readdir = sf_readdir,
	.open = sf_open,
	.read = sf_read,
	.release = sf_release,
	.statfs = sf_statfs,
};

static void usage(void)
{
	fprintf(stderr, "usage: slowfs SRC MOUNTPOINT [--latency S] [--bandwidth B] [--eio NAME:OFFSET]... "
	        "[--short-reads] [--shrink NAME:SIZE:AFTER]... [--zero-cut NAME:SIZE:AFTER]... "
	        "[--max-background N] [--congestion-threshold N] [--max-read BYTES] [--max-pages N] "
	        "[--max-readahead BYTES] [--no-async-dio] [--no-direct] [--direct-io] [--keep-cache] "
	        "[--attr-timeout S] [--threads N] [--clone-fd] [--debug]\n");
	exit(2);
}

static long long parse_int(const char *s, const char *what)
{
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 0);
	if (errno || *s == '\0' || *end != '\0' || v < 0) {
		fprintf(stderr, "slowfs: bad %s: %s\n", what, s);
		exit(2);
	}
	return v;
}

static double parse_double(const char *s, const char *what)
{
	char *end;
	double v = strtod(s, &end);
	if (*s == '\0' || *end != '\0' || !(v >= 0)) {
		fprintf(stderr, "slowfs: bad %s: %s\n", what, s);
		exit(2);
	}
	return v;
}

/* "NAME:A" or "NAME:A:B": NAME may itself contain ':' (split from the right). */
static char *split_right(char *spec, int fields, long long *out, const char *what)
{
	for (int i = fields - 1; i >= 0; i--) {
		char *c = strrchr(spec, ':');
		if (!c) { fprintf(stderr, "slowfs: bad %s: %s\n", what, spec); exit(2); }
		*c = '\0';
		out[i] = parse_int(c + 1, what);
	}
	while (*spec == '/') spec++;
	return spec;
}

int main(int argc, char **argv)
{
	const char *pos[2];
	int npos = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
#define ARG() (i + 1 < argc ? argv[++i] : (usage(), ""))
		if (strcmp(a, "--latency") == 0) opt.latency = parse_double(ARG(), a);
		else if (strcmp(a, "--bandwidth") == 0) opt.bandwidth = parse_double(ARG(), a);
		else if (strcmp(a, "--eio") == 0) {
			if (opt.n_eio == MAX_SPECS) usage();
			long long v[1];
			char *name = split_right(strdup(ARG()), 1, v, a);
			opt.eio[opt.n_eio++] = (struct eio_spec){ name, v[0] };
		} else if (strcmp(a, "--shrink") == 0 || strcmp(a, "--zero-cut") == 0) {
			if (opt.n_shrink == MAX_SPECS) usage();
			long long v[2];
			char *name = split_right(strdup(ARG()), 2, v, a);
			opt.shrink[opt.n_shrink++] = (struct shrink_spec){ name, v[0], v[1], strcmp(a, "--zero-cut") == 0, 0, 0, 0 };
		} else if (strcmp(a, "--short-reads") == 0) opt.short_reads = 1;
		else if (strcmp(a, "--max-background") == 0) opt.max_background = parse_int(ARG(), a);
		else if (strcmp(a, "--congestion-threshold") == 0) opt.congestion_threshold = parse_int(ARG(), a);
		else if (strcmp(a, "--max-read") == 0) opt.max_read = parse_int(ARG(), a);
		else if (strcmp(a, "--max-pages") == 0) opt.max_pages = parse_int(ARG(), a);
		else if (strcmp(a, "--max-readahead") == 0) opt.max_readahead = parse_int(ARG(), a);
		else if (strcmp(a, "--no-async-dio") == 0) opt.no_async_dio = 1;
		else if (strcmp(a, "--no-direct") == 0) opt.no_direct = 1;
		else if (strcmp(a, "--direct-io") == 0) opt.direct_io = 1;
		else if (strcmp(a, "--keep-cache") == 0) opt.keep_cache = 1;
		else if (strcmp(a, "--attr-timeout") == 0) opt.attr_timeout = parse_double(ARG(), a);
		else if (strcmp(a, "--threads") == 0) opt.threads = (int)parse_int(ARG(), a);
		else if (strcmp(a, "--clone-fd") == 0) opt.clone_fd = 1;
		else if (strcmp(a, "--fsname") == 0) opt.fsname = ARG();
		else if (strcmp(a, "--hold-after") == 0) opt.hold_after = parse_int(ARG(), a);
		else if (strcmp(a, "--debug") == 0) opt.debug = 1;
		else if (a[0] == '-' && a[1] != '\0') { fprintf(stderr, "slowfs: unknown option %s\n", a); usage(); }
		else if (npos < 2) pos[npos++] = a;
		else usage();
#undef ARG
	}
	if (npos != 2 || opt.threads < 1) usage();
	if (!realpath(pos[0], opt.root)) { perror(pos[0]); return 1; }
	if (strcmp(opt.root, "/") == 0) opt.root[0] = '\0';

	char mount_opts[256];
	if (strpbrk(opt.fsname, ", \t\n") || !*opt.fsname) { fprintf(stderr, "slowfs: bad --fsname\n"); return 2; }
	int n = snprintf(mount_opts, sizeof mount_opts, "ro,fsname=%s,subtype=slowfs", opt.fsname);
	if (opt.max_read > 0)
		snprintf(mount_opts + n, sizeof mount_opts - n, ",max_read=%lld", opt.max_read);
	char *fargv[] = { argv[0], "-o", mount_opts, opt.debug ? "-d" : NULL, NULL };
	struct fuse_args args = FUSE_ARGS_INIT(opt.debug ? 4 : 3, fargv);

	struct fuse *f = fuse_new(&args, &ops, sizeof ops, NULL);
	if (!f) return 1;
	int rc = 1;
	if (fuse_mount(f, pos[1]) != 0) goto destroy;
	struct fuse_session *se = fuse_get_session(f);
	if (fuse_set_signal_handlers(se) != 0) goto unmount;
#if FUSE_USE_VERSION >= 312
	struct fuse_loop_config *cfg = fuse_loop_cfg_create();
	fuse_loop_cfg_set_max_threads(cfg, (unsigned)opt.threads);
	fuse_loop_cfg_set_idle_threads(cfg, (unsigned)opt.threads);  /* never reap a worker */
	fuse_loop_cfg_set_clone_fd(cfg, (unsigned)opt.clone_fd);
	rc = fuse_loop_mt(f, cfg) != 0;
	fuse_loop_cfg_destroy(cfg);
#else  /* libfuse < 3.12: no thread cap; workers are started as needed */
	struct fuse_loop_config cfg = { .clone_fd = opt.clone_fd, .max_idle_threads = (unsigned)opt.threads };
	rc = fuse_loop_mt(f, &cfg) != 0;
#endif
	fuse_remove_signal_handlers(se);
	char line[512];
	stats_line(line, sizeof line, 0);
	fprintf(stderr, "slowfs: exit: %s", line);
unmount:
	fuse_unmount(f);
destroy:
	fuse_destroy(f);
	fuse_opt_free_args(&args);
	return rc;
}
