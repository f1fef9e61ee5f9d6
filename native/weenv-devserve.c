/*
 * weenv-devserve: the native server of a kernel-path mount's data devices.
 *
 * On the kernel path (docs/design-notes.md, "The kernel path") each group is an EROFS image
 * whose file data lives on a virtual data device, one read-only file per group in a FUSE
 * folder the mount daemon owns. Every EROFS page-cache miss is one FUSE read of one of those
 * files: ~1,700 for `import numpy, pandas`, each on the reader's critical path. Answered by
 * Python (pyfuse3, trio, the reader) one cost ~150-250 us; this program answers the common
 * one, a read whose chunks the daemon has already fetched and verified, in C: the device
 * range is split into file ranges (the group's device layout), those into chunk ranges (the
 * group's index), and each is read with pread(2) from the verified chunk file the daemon
 * handed over. Everything else goes to the daemon, which answers it on the FUSE device
 * itself: reads of chunks it has not handed over (it fetches, verifies and caches them as
 * ever, then hands their files over), the stats xattr. So this program never fetches, never
 * decodes and never decides that bytes are right: it serves only files the daemon verified,
 * and anything odd (an index record that does not fit, a short read) is the daemon's to
 * answer.
 *
 * Usage (by weenvfs/fuse/native_devices.py, never by hand):
 *   weenv-devserve FUSE_FD CHANNEL_FD MAP_FD COUNTERS_FD [CACHE_DIR BOOT_ID]
 * FUSE_FD: /dev/fuse of the mounted device folder (the daemon keeps a copy to answer what it
 * is forwarded). CHANNEL_FD: a SOCK_SEQPACKET socket to the daemon. MAP_FD: the devices'
 * map (format below). COUNTERS_FD: one page of shared u64 counters the daemon reads.
 * CACHE_DIR, BOOT_ID: the node cache and the marker of a chunk file verified in this boot;
 * a chunk whose cached file carries it is served without asking (the cache's own rule).
 *
 * The map, little-endian: "WEDVMAP1", u32 device count, u32 0; per device 64 bytes: name
 * (16, NUL-padded), u64 size, u32 chunk size, u32 inode count, u32 chunk count, u32 blob count,
 * u64 offset of the saved layout (format/device_layout.py `to_bytes`), u64 offset of the
 * index's inode table, u64 offset of its chunk table (SPEC.md 6.4, 6.6).
 *
 * Channel records (32 bytes each, several per message) to the daemon: 'R' a read to answer
 * (dev, flags bit 0: it continues the file's last read, size, unique, device offset, and in
 * the last field the id of the task that asked, the FUSE header's pid: the daemon tells the
 * kernel's own retry of a failed read from a new read by it, docs/design-notes.md), 'X'
 * the stats xattr (size, unique), 'T' a file range this program served
 * that starts a file or reaches a chunk no reported read reached (dev, flags, length, file
 * offset, inode): the daemon's read-ahead and hint recording see what they would have seen
 * (each chunk once, at any position), 'U' a trusted cached chunk this program
 * opened itself (dev, chunk in `ino`): its first use, 'W' a chunk this program fetched,
 * verified and cached (dev, chunk in `ino`, frame length in `size`, nanoseconds it took in
 * `offset`), 'E' every device handle released.
 * From the daemon, each record with one descriptor (SCM_RIGHTS), one kind per message:
 * 8-byte records ('C', 0, u16 dev, u32 chunk): chunk `chunk` of device `dev` is cached and
 * verified in it; 24-byte records ('F', flags, u16 dev, u32 blob, u64 start, u64 length):
 * its bytes from 0 are bytes [start, start + length) of blob `blob` (the index's blob table)
 * of device `dev`, as stored (frame sources, above); flags bit 0: it expires (a neighbourhood
 * the daemon fetched: kept SOURCE_TTL_NS at most, SOURCE_BYTES of them at most).
 *
 * Frame sources (built with WEENV_DECODE: zstd and BLAKE3's C sources, scripts/setup.sh): the
 * daemon may hand over, per device and blob, a descriptor whose bytes are a range of the blob
 * as stored ('F' records: a local folder store's blob files, and the neighbourhoods its
 * fetcher brings from any other store, in memfds). A chunk neither handed over nor
 * trusted whose frame lies in one is fetched here, as the daemon's fetcher would: under the
 * chunk's cross-process lock (weenvfs/core/chunk_locks.py), the frame is read, its declared
 * size checked, decompressed, its BLAKE3 compared with the index's digest, and written to the
 * node cache as weenvfs/core/cache.py writes a chunk (a temp file, the trust marker, a rename),
 * then served from that file; a 'W' record tells the daemon (stats, the cache's size bound).
 * Anything that does not go exactly so (no source, the lock held, a short read, a bad frame, a
 * digest that differs, a cache write that fails) leaves the read to the daemon, whose fetcher
 * retries, reports and answers EIO as ever: bytes that do not verify are never served.
 *
 * Ends when the folder is unmounted (ENODEV) or the daemon's end of the channel closes (then
 * the FUSE connection goes with the last descriptor: readers get errors, never a hang).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>
#ifdef WEENV_DECODE
#include <blake3.h>
#include <zstd.h>
#endif

#define BLOCK_SIZE 4096u
#define MAX_PAGES 256u                       /* 1 MiB reads, as libfuse negotiates */
#define BUFFER_SIZE ((MAX_PAGES + 1) * 4096u) /* a request: header + up to 1 MiB */
#define INODE_SIZE 72u
#define CHUNK_SIZE_RECORD 56u
#define CHUNK_ZERO 1u
#define MAX_HELD 256u /* chunk files held open at once (each keeps its disk space) */
#define ROOT 1u
#define STATS_XATTR "user.weenv.stats"
#define TRUST_XATTR "user.weenv.verified"
#define TIMEOUT_S 3600
#define MAX_SOURCES 65536u /* frame sources held at once (one per blob file of a folder store) */
/* Sources that expire (flag bit 0: a neighbourhood the daemon fetched, in a memfd) go after
 * this long or when they hold more than this many bytes, oldest first (the daemon's own
 * stash, weenvfs/core/frame_stash.py, has the same bounds: a burst of reads is over soon). */
#define SOURCE_TTL_NS (10ull * 1000000000ull)
#define SOURCE_BYTES (192ull << 20)
#define MAX_EXPIRING 4096u
/* A chunk record's bounds, as format/constants.py and GroupIndex.chunk check them: a chunk of
 * at most MAX_CHUNK_SIZE bytes, a frame of at most ulen + ulen/128 + FRAME_SLACK. */
#define MAX_CHUNK_SIZE (64u << 20)
#define FRAME_SLACK 1024u

enum { C_READS, C_BYTES, C_HITS, C_ZERO, C_FORWARDED, C_OPEN, C_HELD, C_DECODED, C_DECODER,
       C_COUNTERS };

struct record { /* to the daemon */
    uint8_t type, flags;
    uint16_t dev;
    uint32_t size;
    uint64_t unique;
    uint64_t offset;
    uint32_t ino;
    uint32_t pid; /* 'R': the task that asked (0: unknown) */
};

/* Bytes [start, start + length) of a blob as stored, at offset 0 of `fd`. */
struct source {
    struct source *next;
    uint64_t start, length;
    int fd;
    uint32_t dev, blob;
    uint64_t arrived; /* CLOCK_MONOTONIC ns; 0: never expires */
};

struct device {
    char name[17];
    uint64_t size, chunk_size;
    uint32_t extents, inode_count, chunk_count, blob_count;
    struct source **sources;             /* per blob of the index: its frame sources */
    const uint8_t *inos, *sizes, *first; /* the saved layout's columns */
    const uint8_t *inodes, *chunks;      /* the index's tables */
    int32_t *fd;                         /* per chunk: its verified file, or -1 */
    uint64_t *last_end;                  /* per extent: end of its last read + 1, 0 none */
    uint8_t *file_told;                  /* per extent: a read of it reported ('T') */
    uint8_t *chunk_told;                 /* per chunk of the index: a read of it reported */
};

static struct device *devices;
static uint32_t device_count;
static int fuse_fd, channel_fd;
static volatile uint64_t *counters;
static uint32_t held;
/* Hand-overs in arrival order: the oldest is closed to make room (a chunk read again after
 * that costs one more round trip to the daemon). */
static struct { uint32_t dev, chunk; } ring[MAX_HELD];
static uint32_t ring_head, ring_len;
static struct record out[128];
static unsigned out_count;
static uint64_t open_handles;
static uint32_t minor_version = FUSE_KERNEL_MINOR_VERSION;

static void die(const char *what) {
    fprintf(stderr, "weenv-devserve: %s: %s\n", what, strerror(errno));
    exit(1);
}

static uint32_t le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return le32toh(v); }
static uint64_t le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return le64toh(v); }

/* -- the map ---------------------------------------------------------------------------- */

static int in_map(uint64_t offset, uint64_t length, uint64_t map_size) {
    return offset <= map_size && length <= map_size - offset;
}

static void load_map(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0) die("map");
    uint64_t map_size = (uint64_t)st.st_size;
    if (map_size < 16) { errno = EINVAL; die("map too short"); }
    const uint8_t *map = mmap(NULL, map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) die("mmap map");
    if (memcmp(map, "WEDVMAP1", 8) != 0) { errno = EINVAL; die("map magic"); }
    device_count = le32(map + 8);
    if (device_count == 0 || device_count > 4096 || !in_map(16, 64ull * device_count, map_size)) {
        errno = EINVAL;
        die("map device count");
    }
    devices = calloc(device_count, sizeof *devices);
    for (uint32_t d = 0; d < device_count; d++) {
        const uint8_t *h = map + 16 + 64ull * d;
        struct device *dev = &devices[d];
        memcpy(dev->name, h, 16);
        dev->size = le64(h + 16);
        dev->chunk_size = le32(h + 24);
        dev->inode_count = le32(h + 28);
        dev->chunk_count = le32(h + 32);
        dev->blob_count = le32(h + 36);
        uint64_t layout = le64(h + 40), inodes = le64(h + 48), chunks = le64(h + 56);
        if (!in_map(layout, 16, map_size) || memcmp(map + layout, "WEENVDL1", 8) != 0
            || le64(map + layout + 8) > UINT32_MAX) {
            errno = EINVAL;
            die("map layout");
        }
        dev->extents = (uint32_t)le64(map + layout + 8);
        uint64_t n = dev->extents;
        if (!in_map(layout + 16, 20 * n + 8, map_size)
            || !in_map(inodes, (uint64_t)INODE_SIZE * dev->inode_count, map_size)
            || !in_map(chunks, (uint64_t)CHUNK_SIZE_RECORD * dev->chunk_count, map_size)
            || dev->chunk_size == 0 || dev->size % BLOCK_SIZE) {
            errno = EINVAL;
            die("map sections");
        }
        dev->inos = map + layout + 16;
        dev->sizes = dev->inos + 4 * n;
        dev->first = dev->sizes + 8 * n;
        dev->inodes = map + inodes;
        dev->chunks = map + chunks;
        dev->fd = malloc(sizeof(int32_t) * (dev->chunk_count + 1));
        dev->last_end = calloc(n + 1, sizeof(uint64_t));
        dev->file_told = calloc(n + 1, 1);
        dev->chunk_told = calloc(dev->chunk_count + 1, 1);
        dev->sources = calloc(dev->blob_count + 1, sizeof *dev->sources);
        if (!dev->fd || !dev->last_end || !dev->file_told || !dev->chunk_told || !dev->sources)
            die("memory");
        for (uint32_t c = 0; c <= dev->chunk_count; c++) dev->fd[c] = -1;
    }
}

/* -- FUSE replies ----------------------------------------------------------------------- */

static void reply(uint64_t unique, int error, const void *data, size_t size) {
    struct fuse_out_header header = {
        .len = (uint32_t)(sizeof header + (error ? 0 : size)), .error = -error, .unique = unique};
    struct iovec iov[2] = {{&header, sizeof header}, {(void *)data, error ? 0 : size}};
    /* ENOENT: the request was interrupted meanwhile; nothing waits for this answer. */
    if (writev(fuse_fd, iov, 2) < 0 && errno != ENOENT && errno != ENODEV)
        fprintf(stderr, "weenv-devserve: reply: %s\n", strerror(errno));
}

static void fill_attr(struct fuse_attr *attr, uint64_t nodeid) {
    memset(attr, 0, sizeof *attr);
    attr->ino = nodeid;
    attr->uid = getuid();
    attr->gid = getgid();
    if (nodeid == ROOT) {
        attr->mode = S_IFDIR | 0500;
        attr->nlink = 2;
        return;
    }
    const struct device *dev = &devices[nodeid - ROOT - 1];
    attr->mode = S_IFREG | 0400;
    attr->nlink = 1;
    attr->size = dev->size;
    attr->blocks = (dev->size + 511) / 512;
    attr->blksize = 1u << 20;
}

static int valid_node(uint64_t nodeid) { return nodeid >= ROOT && nodeid <= ROOT + device_count; }

static void reply_entry(uint64_t unique, uint64_t nodeid) {
    struct fuse_entry_out entry = {.nodeid = nodeid, .entry_valid = TIMEOUT_S,
                                   .attr_valid = TIMEOUT_S};
    fill_attr(&entry.attr, nodeid);
    reply(unique, 0, &entry, sizeof entry);
}

/* -- the channel to the daemon ---------------------------------------------------------- */

static void flush_records(void) {
    if (out_count == 0) return;
    ssize_t sent;
    do sent = send(channel_fd, out, out_count * sizeof out[0], 0);
    while (sent < 0 && errno == EINTR);
    if (sent < 0) exit(0); /* the daemon is gone: so is everything this program serves */
    out_count = 0;
}

static void push_record(const struct record *r, int urgent) {
    if (out_count == sizeof out / sizeof out[0]) flush_records();
    out[out_count++] = *r;
    if (urgent) flush_records();
}

static void close_chunk(struct device *dev, uint32_t chunk) {
    if (dev->fd[chunk] >= 0) {
        close(dev->fd[chunk]);
        dev->fd[chunk] = -1;
        held--;
        counters[C_HELD] = held;
    }
}

static void hold(uint32_t d, uint32_t chunk, int fd) {
    struct device *dev = &devices[d];
    close_chunk(dev, chunk);
    if (ring_len == MAX_HELD) { /* the oldest hand-over goes (if still held) */
        close_chunk(&devices[ring[ring_head].dev], ring[ring_head].chunk);
        ring_head = (ring_head + 1) % MAX_HELD;
        ring_len--;
    }
    ring[(ring_head + ring_len) % MAX_HELD].dev = d;
    ring[(ring_head + ring_len) % MAX_HELD].chunk = chunk;
    ring_len++;
    dev->fd[chunk] = fd;
    held++;
    counters[C_HELD] = held;
}

static uint32_t source_count;
/* The expiring sources, oldest first, and their bytes. */
static struct source *expiring[MAX_EXPIRING];
static uint32_t expiring_head, expiring_len;
static uint64_t expiring_bytes;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void drop_oldest_source(void) {
    struct source *s = expiring[expiring_head];
    expiring_head = (expiring_head + 1) % MAX_EXPIRING;
    expiring_len--;
    expiring_bytes -= s->length;
    for (struct source **at = &devices[s->dev].sources[s->blob]; *at; at = &(*at)->next)
        if (*at == s) {
            *at = s->next;
            break;
        }
    close(s->fd);
    free(s);
    source_count--;
}

/* Drops expiring sources past their time, and more while over `room` bytes or entries. */
static void expire_sources(uint64_t room, uint32_t entries) {
    uint64_t now = now_ns();
    while (expiring_len > 0
           && (now - expiring[expiring_head]->arrived > SOURCE_TTL_NS
               || expiring_bytes > room || expiring_len > entries))
        drop_oldest_source();
}

/* Blob bytes [start, start + length) of `blob` of device `d` are at offset 0 of `fd`;
 * `expires`: a neighbourhood (bounded in time and bytes), else for the mount's life. */
static void add_source(uint32_t d, uint32_t blob, uint64_t start, uint64_t length, int fd,
                       int expires) {
#ifndef WEENV_DECODE
    close(fd); /* nothing here could use it */
    return;
#endif
    if (expires) expire_sources(length > SOURCE_BYTES ? 0 : SOURCE_BYTES - length,
                                MAX_EXPIRING - 1);
    struct source *s = source_count < MAX_SOURCES ? malloc(sizeof *s) : NULL;
    if (s == NULL || blob >= devices[d].blob_count || length == 0
        || (expires && length > SOURCE_BYTES)) {
        free(s);
        close(fd);
        return;
    }
    *s = (struct source){devices[d].sources[blob], start, length, fd, d, blob,
                         expires ? now_ns() | 1 : 0};
    devices[d].sources[blob] = s;
    source_count++;
    if (expires) {
        expiring[(expiring_head + expiring_len++) % MAX_EXPIRING] = s;
        expiring_bytes += length;
    }
}

/* Takes one message of hand-overs or sources; 0 when none is waiting. */
static int take_chunks(void) {
    uint8_t data[24 * 64];
    union { char buf[CMSG_SPACE(sizeof(int) * 64)]; struct cmsghdr align; } control;
    struct iovec iov = {data, sizeof data};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t got = recvmsg(channel_fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (got <= 0) exit(0); /* the daemon closed the channel */
    int fds[64];
    size_t nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            memcpy(fds + nfds, CMSG_DATA(c), n * sizeof(int));
            nfds += n;
        }
    size_t width = data[0] == 'F' ? 24 : 8, records = (size_t)got / width;
    for (size_t k = 0; k < nfds; k++) {
        const uint8_t *r = data + width * k;
        uint32_t d = r[2] | (uint32_t)r[3] << 8, number = le32(r + 4);
        /* A record without its descriptor, or one naming nothing: drop the descriptor. */
        if (k >= records || r[0] != data[0] || d >= device_count || (msg.msg_flags & MSG_CTRUNC)
            || (r[0] == 'C' && number >= devices[d].chunk_count) || (r[0] != 'C' && r[0] != 'F')) {
            close(fds[k]);
            continue;
        }
        if (r[0] == 'C') hold(d, number, fds[k]);
        else add_source(d, number, le64(r + 8), le64(r + 16), fds[k], r[1] & 1);
    }
    return 1;
}

/* -- the node cache's trusted chunks ------------------------------------------------------ */

/* The daemon's chunk cache trusts a file that carries this boot's id in its marker xattr:
 * some process verified it in this boot (weenvfs/core/cache.py, `is_trusted`). So does this
 * program, for a chunk not handed over yet: a node whose cache holds the chunks (a hint's
 * replay fetched them, an earlier mount did) is served without a round trip per chunk. */
static int cache_dir = -1;
static char boot[128];
static ssize_t boot_len = -1;

/* "xx/<64 hex>": where chunk record `rec`'s chunk is cached, under the cache folder. */
static void chunk_name(const uint8_t *rec, char name[3 + 64 + 1]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        name[3 + 2 * i] = hex[rec[i] >> 4];
        name[3 + 2 * i + 1] = hex[rec[i] & 15];
    }
    name[0] = name[3], name[1] = name[4], name[2] = '/', name[67] = 0;
}

static int open_trusted(const uint8_t *rec) {
    if (cache_dir < 0 || boot_len <= 0) return -1;
    char path[3 + 64 + 1];
    chunk_name(rec, path);
    int fd = openat(cache_dir, path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return -1;
    char mark[sizeof boot];
    struct stat st;
    ssize_t n = fgetxattr(fd, TRUST_XATTR, mark, sizeof mark);
    if (n != boot_len || memcmp(mark, boot, (size_t)n) != 0 || fstat(fd, &st) != 0
        || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != le32(rec + 52) || st.st_nlink == 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* -- chunks fetched here from frame sources --------------------------------------------- */

#ifdef WEENV_DECODE
static int cannot_mark; /* the cache's file system refused the trust marker: fetch nothing */
static ZSTD_DCtx *dctx;
static uint8_t *frame_buffer, *plain_buffer;
static size_t frame_room, plain_room;

static int room(uint8_t **buffer, size_t *have, size_t need) {
    if (need <= *have) return 1;
    uint8_t *bigger = realloc(*buffer, need);
    if (bigger == NULL) return 0;
    *buffer = bigger;
    *have = need;
    return 1;
}

static const struct source *source_of(const struct device *dev, uint32_t blob, uint64_t offset,
                                      uint64_t clen) {
    if (blob >= dev->blob_count) return NULL;
    if (expiring_len > 0) expire_sources(SOURCE_BYTES, MAX_EXPIRING);
    for (const struct source *s = dev->sources[blob]; s; s = s->next)
        if (offset >= s->start && clen <= s->length && offset - s->start <= s->length - clen)
            return s;
    return NULL;
}

static int read_exactly(int fd, uint8_t *to, uint64_t length, uint64_t at) {
    for (uint64_t done = 0; done < length;) {
        ssize_t n = pread(fd, to + done, length - done, (off_t)(at + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        done += (uint64_t)n;
    }
    return 1;
}

/* The chunk's cross-process fetch lock (weenvfs/core/chunk_locks.py: flock on
 * locks/<hex>, unlinked by its holder before it unlocks), without waiting: -1 when another
 * process holds it (the daemon then waits for that fetch as its fetcher does). */
static int try_lock(const char *path) {
    int fd = openat(cache_dir, path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return -1;
    struct stat held, named;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &held) != 0
        || fstatat(cache_dir, path, &named, AT_SYMLINK_NOFOLLOW) != 0
        || held.st_dev != named.st_dev || held.st_ino != named.st_ino) {
        close(fd); /* held, or its holder unlinked it meanwhile: the daemon's to fetch */
        return -1;
    }
    return fd;
}

static void unlock(int fd, const char *path) {
    unlinkat(cache_dir, path, 0);
    close(fd);
}

/* Writes `length` verified bytes as cache file `name` the way the cache does (a temp file
 * flocked while written, this boot's trust marker, a rename into place); its descriptor, or
 * -1 when it could not (the daemon then fetches the chunk and handles a full disk). */
static int write_cached(const char *name, const uint8_t *plain, uint64_t length) {
    uint32_t random = 0;
    if (getrandom(&random, sizeof random, GRND_NONBLOCK) != sizeof random)
        random = (uint32_t)rand();
    char temp[96];
    snprintf(temp, sizeof temp, "tmp/%s.%d.%08x", name + 3, (int)getpid(), random);
    int fd = openat(cache_dir, temp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    int ok = flock(fd, LOCK_EX | LOCK_NB) == 0;
    for (uint64_t done = 0; ok && done < length;) {
        ssize_t n = write(fd, plain + done, length - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) ok = 0;
        else done += (uint64_t)n;
    }
    if (ok && fsetxattr(fd, TRUST_XATTR, boot, (size_t)boot_len, 0) != 0) {
        ok = 0;
        cannot_mark = errno == ENOTSUP || errno == EOPNOTSUPP;
    }
    if (ok && renameat(cache_dir, temp, cache_dir, name) != 0) {
        char folder[3] = {name[0], name[1], 0}; /* the subfolder's first chunk */
        ok = errno == ENOENT && (mkdirat(cache_dir, folder, 0777) == 0 || errno == EEXIST)
             && renameat(cache_dir, temp, cache_dir, name) == 0;
    }
    if (!ok) {
        unlinkat(cache_dir, temp, 0);
        close(fd);
        return -1;
    }
    flock(fd, LOCK_UN);
    return fd;
}

/* Fetches chunk `chunk` of `dev` (record `rec`) from a frame source as the daemon's fetcher
 * would (the file's header): the verified cache file's descriptor, or -1 (the daemon's). */
static int fetch_from_source(struct device *dev, uint32_t chunk, const uint8_t *rec) {
    uint64_t offset = le64(rec + 40), clen = le32(rec + 48), ulen = le32(rec + 52);
    /* A record out of bounds is the daemon's to refuse (EIO, logged), before any allocation:
     * a hostile clen made this process read gigabytes for one chunk. */
    if (ulen == 0 || clen == 0 || ulen > MAX_CHUNK_SIZE || clen > ulen + (ulen >> 7) + FRAME_SLACK)
        return -1;
    const struct source *source = source_of(dev, le32(rec + 32), offset, clen);
    if (source == NULL || cache_dir < 0 || boot_len <= 0 || cannot_mark) return -1;
    struct timespec began, ended;
    clock_gettime(CLOCK_MONOTONIC, &began);
    char name[3 + 64 + 1], lock[6 + 64 + 1];
    chunk_name(rec, name);
    snprintf(lock, sizeof lock, "locks/%s", name + 3);
    int lock_fd = try_lock(lock);
    if (lock_fd < 0) return -1;
    int fd = open_trusted(rec); /* cached by another process just before the lock */
    if (fd >= 0) {
        unlock(lock_fd, lock);
        struct record used = {.type = 'U', .dev = (uint16_t)(dev - devices), .ino = chunk};
        push_record(&used, 0);
        return fd;
    }
    uint8_t digest[32];
    blake3_hasher hasher;
    size_t plain = 0;
    if (room(&frame_buffer, &frame_room, clen) && room(&plain_buffer, &plain_room, ulen)
        && read_exactly(source->fd, frame_buffer, clen, offset - source->start)
        && ZSTD_getFrameContentSize(frame_buffer, clen) == ulen) /* before decompressing */
        plain = ZSTD_decompressDCtx(dctx, plain_buffer, ulen, frame_buffer, clen);
    if (plain == ulen && !ZSTD_isError(plain)) {
        blake3_hasher_init(&hasher);
        blake3_hasher_update(&hasher, plain_buffer, ulen);
        blake3_hasher_finalize(&hasher, digest, sizeof digest);
        if (memcmp(digest, rec, sizeof digest) == 0) fd = write_cached(name, plain_buffer, ulen);
    }
    unlock(lock_fd, lock);
    if (fd < 0) return -1;
    clock_gettime(CLOCK_MONOTONIC, &ended);
    uint64_t took = (uint64_t)(ended.tv_sec - began.tv_sec) * 1000000000u
                    + (uint64_t)ended.tv_nsec - (uint64_t)began.tv_nsec;
    struct record fetched = {.type = 'W', .dev = (uint16_t)(dev - devices), .size = (uint32_t)clen,
                             .offset = took, .ino = chunk};
    push_record(&fetched, 0);
    counters[C_DECODED]++;
    return fd;
}
#else
static int fetch_from_source(struct device *dev, uint32_t chunk, const uint8_t *rec) {
    return -1; /* built without zstd and BLAKE3: the daemon fetches every chunk */
}
#endif

/* -- reads ------------------------------------------------------------------------------ */

/* Copies bytes [start, end) of chunk `chunk` of `dev` to `to`; 0 when it cannot (neither
 * handed over nor trusted, evicted from the cache, short): the daemon answers that read. */
static int copy_chunk(struct device *dev, uint32_t chunk, uint64_t start, uint64_t end,
                      uint8_t *to, uint64_t *hits) {
    const uint8_t *rec = dev->chunks + (uint64_t)CHUNK_SIZE_RECORD * chunk;
    if (end > le32(rec + 52)) return 0;
    if (le32(rec + 36) & CHUNK_ZERO) {
        memset(to, 0, end - start);
        counters[C_ZERO]++;
        return 1;
    }
    int fd = dev->fd[chunk];
    if (fd < 0 && (fd = open_trusted(rec)) >= 0) {
        hold((uint32_t)(dev - devices), chunk, fd);
        struct record used = {.type = 'U', .dev = (uint16_t)(dev - devices), .ino = chunk};
        push_record(&used, 0);
    }
    if (fd < 0 && (fd = fetch_from_source(dev, chunk, rec)) >= 0)
        hold((uint32_t)(dev - devices), chunk, fd);
    if (fd < 0) return 0;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_nlink == 0) { /* evicted: let the cache have its space */
        close_chunk(dev, chunk);
        return 0;
    }
    for (uint64_t at = start; at < end;) {
        ssize_t n = pread(fd, to + (at - start), end - at, (off_t)at);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            close_chunk(dev, chunk);
            return 0;
        }
        at += (uint64_t)n;
    }
    (*hits)++;
    return 1;
}

/* Whether chunk `chunk` is read for the first time (then marked): every chunk a read touches
 * is reported once, whatever its position. A high-water mark per file left out the chunks
 * below the highest one reported: a library whose first and last chunks were read first
 * never had its second recorded, and a run with that hint fetched it on demand. */
static int tell_chunk(struct device *dev, uint32_t chunk) {
    if (dev->chunk_told[chunk]) return 0;
    dev->chunk_told[chunk] = 1;
    return 1;
}

/* Copies bytes [a, b) of the file of extent `k` to `to`, setting `*untold` when it touches a
 * chunk not reported before; 0 when the daemon must answer. */
static int copy_file_bytes(struct device *dev, uint32_t k, uint64_t a, uint64_t b,
                            uint8_t *to, uint64_t *hits, int *untold) {
    uint32_t ino = le32(dev->inos + 4ull * k);
    uint64_t size = le64(dev->sizes + 8ull * k);
    if (ino >= dev->inode_count) return 0;
    const uint8_t *rec = dev->inodes + (uint64_t)INODE_SIZE * ino;
    uint64_t first = le32(rec + 48), count = le32(rec + 52), inner = le32(rec + 56);
    if (le64(rec + 16) != size || first + count > dev->chunk_count || count == 0) return 0;
    if (count == 1) {
        *untold |= tell_chunk(dev, (uint32_t)first);
        return copy_chunk(dev, (uint32_t)first, inner + a, inner + b, to, hits);
    }
    if (inner != 0 || count != (size + dev->chunk_size - 1) / dev->chunk_size) return 0;
    for (uint64_t pos = a; pos < b;) {
        uint64_t position = pos / dev->chunk_size, in_chunk = pos % dev->chunk_size;
        uint64_t stop = in_chunk + (b - pos) < dev->chunk_size ? in_chunk + (b - pos)
                                                                : dev->chunk_size;
        uint64_t expected = size - position * dev->chunk_size;
        if (expected > dev->chunk_size) expected = dev->chunk_size;
        const uint8_t *crec = dev->chunks + (uint64_t)CHUNK_SIZE_RECORD * (first + position);
        if (le32(crec + 52) != expected) return 0; /* a record that does not fit: the daemon's */
        if (!copy_chunk(dev, (uint32_t)(first + position), in_chunk, stop, to + (pos - a), hits))
            return 0;
        *untold |= tell_chunk(dev, (uint32_t)(first + position));
        pos += stop - in_chunk;
    }
    return 1;
}

/* The first extent whose blocks reach past `block`. */
static uint32_t extent_at(const struct device *dev, uint64_t block) {
    uint32_t lo = 0, hi = dev->extents; /* first[k] <= block < first[k + 1] */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (le64(dev->first + 8ull * (mid + 1)) <= block) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static uint8_t data[1u << 20];

static void forward_read(uint32_t d, uint64_t unique, uint64_t offset, uint32_t size, int follows,
                         uint32_t pid) {
    struct record r = {.type = 'R', .flags = (uint8_t)follows, .dev = (uint16_t)d,
                       .size = size, .unique = unique, .offset = offset, .pid = pid};
    counters[C_FORWARDED]++;
    push_record(&r, 1);
}

static void do_read(uint64_t unique, uint64_t nodeid, uint32_t pid,
                    const struct fuse_read_in *in) {
    struct device *dev = &devices[nodeid - ROOT - 1];
    uint32_t d = (uint32_t)(nodeid - ROOT - 1);
    uint64_t offset = in->offset, size = in->size;
    if (size > sizeof data) size = sizeof data;
    if (offset >= dev->size) { reply(unique, 0, NULL, 0); return; }
    if (size > dev->size - offset) size = dev->size - offset;
    uint64_t end = offset + size, at = offset, hits = 0, file_bytes = 0;
    struct record touched[MAX_PAGES]; /* a piece per file: files take a block at least */
    unsigned touches = 0;
    int follows_first = -1;
    for (uint32_t k = extent_at(dev, offset / BLOCK_SIZE); k < dev->extents; k++) {
        uint64_t start = le64(dev->first + 8ull * k) * BLOCK_SIZE;
        if (start >= end) break;
        uint64_t file_size = le64(dev->sizes + 8ull * k);
        uint64_t lo = offset > start ? offset : start;
        uint64_t hi = end < start + file_size ? end : start + file_size;
        if (lo >= hi) continue;
        uint64_t a = lo - start, b = hi - start;
        int follows = dev->last_end[k] == a + 1;
        if (follows_first < 0) follows_first = follows;
        memset(data + (at - offset), 0, lo - at);
        int untold = !dev->file_told[k];
        if (!copy_file_bytes(dev, k, a, b, data + (lo - offset), &hits, &untold)) {
            forward_read(d, unique, offset, in->size, follows_first > 0, pid);
            /* The daemon's reader sees this read: remember where it ended. */
            dev->last_end[k] = b + 1;
            return;
        }
        dev->last_end[k] = b + 1;
        file_bytes += b - a;
        if (untold) {
            dev->file_told[k] = 1;
            if (touches < MAX_PAGES)
                touched[touches++] = (struct record){
                    .type = 'T', .flags = (uint8_t)follows, .dev = (uint16_t)d,
                    .size = (uint32_t)(b - a), .offset = a, .ino = le32(dev->inos + 4ull * k)};
        }
        at = hi;
    }
    memset(data + (at - offset), 0, end - at);
    reply(unique, 0, data, size);
    counters[C_READS]++;
    counters[C_BYTES] += file_bytes; /* as the daemon counts: file bytes, not block padding */
    counters[C_HITS] += hits;
    for (unsigned t = 0; t < touches; t++) push_record(&touched[t], 0);
}

/* -- requests --------------------------------------------------------------------------- */

static void do_init(uint64_t unique, const struct fuse_init_in *in) {
    struct fuse_init_out o = {0};
    o.major = FUSE_KERNEL_VERSION;
    o.minor = FUSE_KERNEL_MINOR_VERSION;
    if (in->major < 7) { reply(unique, EPROTO, NULL, 0); return; }
    if (in->major == 7 && in->minor < minor_version) minor_version = in->minor;
    o.max_readahead = in->max_readahead;
    /* ASYNC_DIO: EROFS reads its device with asynchronous direct I/O; without it the kernel
     * sends a large read as one request at a time (libfuse turns it on too). */
    o.flags = in->flags & (FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_MAX_PAGES);
    o.max_background = 64;
    o.congestion_threshold = 48;
    o.max_write = 1u << 20;
    o.time_gran = 1;
    o.max_pages = MAX_PAGES;
    reply(unique, 0, &o, minor_version < 23 ? FUSE_COMPAT_22_INIT_OUT_SIZE : sizeof o);
}

static void do_readdir(uint64_t unique, const struct fuse_read_in *in) {
    uint8_t buf[8192];
    size_t used = 0, limit = in->size < sizeof buf ? in->size : sizeof buf;
    for (uint64_t k = in->offset; k < 2ull + device_count; k++) {
        const char *name = k == 0 ? "." : k == 1 ? ".." : devices[k - 2].name;
        size_t namelen = strlen(name), entsize = FUSE_DIRENT_ALIGN(FUSE_NAME_OFFSET + namelen);
        if (used + entsize > limit) break;
        struct fuse_dirent *ent = (struct fuse_dirent *)(buf + used);
        memset(ent, 0, entsize);
        ent->ino = k < 2 ? ROOT : ROOT + k - 1;
        ent->off = k + 1;
        ent->namelen = (uint32_t)namelen;
        ent->type = k < 2 ? DT_DIR : DT_REG;
        memcpy(ent->name, name, namelen);
        used += entsize;
    }
    reply(unique, 0, buf, used);
}

static void released_one(void) {
    if (open_handles > 0) open_handles--;
    counters[C_OPEN] = open_handles;
    if (open_handles == 0) {
        struct record r = {.type = 'E'};
        push_record(&r, 1);
    }
}

static pid_t daemon_pid; /* this program's parent, the mount daemon */

/* Whether the daemon has ended or is ending: its end of the channel closed, it is no longer
 * this program's parent, or its main thread has exited (a zombie: its other threads, and so
 * its files, may still be on their way out, and whoever waits for it sees it gone). */
static int daemon_ending(void) {
    struct pollfd channel = {.fd = channel_fd, .events = POLLRDHUP};
    if (poll(&channel, 1, 0) != 0 || getppid() != daemon_pid) return 1;
    char path[32], stat[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)daemon_pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    ssize_t got = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (got <= 0) return 1;
    stat[got] = 0;
    const char *end = strrchr(stat, ')'); /* the name may hold anything: the state follows */
    return end == NULL || end[1] != ' ' || end[2] == 'Z' || end[2] == 'X';
}

static void handle(const uint8_t *buf, size_t len) {
    const struct fuse_in_header *h = (const void *)buf;
    const void *arg = buf + sizeof *h;
    uint64_t unique = h->unique, nodeid = h->nodeid;
    if (len < sizeof *h) return;
    switch (h->opcode) {
    case FUSE_INIT: do_init(unique, arg); return;
    case FUSE_FORGET: case FUSE_BATCH_FORGET: case FUSE_INTERRUPT: return; /* no answer */
    case FUSE_DESTROY: reply(unique, 0, NULL, 0); return;
    case FUSE_STATFS: { /* how `weenv sandbox` asks whether the daemon lives: answered here
                         * while it does; once it ends, so does this program, and the
                         * connection with it: the asker gets ENOTCONN */
        if (daemon_ending()) exit(0);
        struct fuse_statfs_out o;
        memset(&o, 0, sizeof o);
        for (uint32_t d = 0; d < device_count; d++) o.st.blocks += devices[d].size / 4096;
        o.st.files = device_count + 1;
        o.st.bsize = o.st.frsize = 4096;
        o.st.namelen = 255;
        reply(unique, 0, &o, sizeof o);
        return;
    }
    }
    if (!valid_node(nodeid)) { reply(unique, ENOENT, NULL, 0); return; }
    switch (h->opcode) {
    case FUSE_LOOKUP: {
        const char *name = arg;
        size_t max = len - sizeof *h;
        if (nodeid != ROOT) { reply(unique, ENOTDIR, NULL, 0); return; }
        if (strnlen(name, max) == max) { reply(unique, EINVAL, NULL, 0); return; }
        if (!strcmp(name, ".") || !strcmp(name, "..")) { reply_entry(unique, ROOT); return; }
        for (uint32_t d = 0; d < device_count; d++)
            if (!strcmp(name, devices[d].name)) { reply_entry(unique, ROOT + 1 + d); return; }
        struct fuse_entry_out negative = {.entry_valid = TIMEOUT_S};
        reply(unique, 0, &negative, sizeof negative);
        return;
    }
    case FUSE_GETATTR: {
        struct fuse_attr_out o = {.attr_valid = TIMEOUT_S};
        fill_attr(&o.attr, nodeid);
        reply(unique, 0, &o, sizeof o);
        return;
    }
    case FUSE_OPEN: {
        const struct fuse_open_in *in = arg;
        if (nodeid == ROOT) { reply(unique, EISDIR, NULL, 0); return; }
        if ((in->flags & O_ACCMODE) != O_RDONLY) { reply(unique, EROFS, NULL, 0); return; }
        struct fuse_open_out o = {.fh = nodeid, .open_flags = FOPEN_DIRECT_IO};
        open_handles++;
        counters[C_OPEN] = open_handles;
        reply(unique, 0, &o, sizeof o);
        return;
    }
    case FUSE_READ:
        if (nodeid == ROOT) { reply(unique, EISDIR, NULL, 0); return; }
        do_read(unique, nodeid, h->pid, arg);
        return;
    case FUSE_RELEASE:
        reply(unique, 0, NULL, 0);
        released_one();
        return;
    case FUSE_OPENDIR: {
        if (nodeid != ROOT) { reply(unique, ENOTDIR, NULL, 0); return; }
        struct fuse_open_out o = {.fh = ROOT};
        reply(unique, 0, &o, sizeof o);
        return;
    }
    case FUSE_READDIR: do_readdir(unique, arg); return;
    case FUSE_RELEASEDIR: reply(unique, 0, NULL, 0); return;
    case FUSE_GETXATTR: {
        const struct fuse_getxattr_in *in = arg;
        const char *name = (const char *)(in + 1);
        size_t max = len - sizeof *h - sizeof *in;
        if (nodeid == ROOT && strnlen(name, max) < max && !strcmp(name, STATS_XATTR)) {
            struct record r = {.type = 'X', .size = in->size, .unique = unique};
            push_record(&r, 1);
            return;
        }
        reply(unique, ENODATA, NULL, 0);
        return;
    }
    case FUSE_LISTXATTR: {
        struct fuse_getxattr_out o = {.size = 0};
        const struct fuse_getxattr_in *in = arg;
        if (in->size == 0) reply(unique, 0, &o, sizeof o);
        else reply(unique, 0, NULL, 0);
        return;
    }
    case FUSE_SETATTR: case FUSE_WRITE: case FUSE_SETXATTR: case FUSE_REMOVEXATTR:
    case FUSE_CREATE: case FUSE_MKNOD: case FUSE_MKDIR: case FUSE_UNLINK: case FUSE_RMDIR:
    case FUSE_RENAME: case FUSE_RENAME2: case FUSE_LINK: case FUSE_SYMLINK:
    case FUSE_FALLOCATE:
        reply(unique, EROFS, NULL, 0);
        return;
    default:
        reply(unique, ENOSYS, NULL, 0); /* FLUSH, ACCESS, IOCTL, POLL...: not asked again */
    }
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 7) {
        fprintf(stderr, "usage: weenv-devserve FUSE_FD CHANNEL_FD MAP_FD COUNTERS_FD "
                        "[CACHE_DIR BOOT_ID]\n"
                        "(started by `weenv mount` on the kernel path; not a command)\n");
        return 2;
    }
    fuse_fd = atoi(argv[1]);
    channel_fd = atoi(argv[2]);
    daemon_pid = getppid();
    int map_fd = atoi(argv[3]), counters_fd = atoi(argv[4]);
    if (argc == 7) {
        cache_dir = open(argv[5], O_PATH | O_DIRECTORY | O_CLOEXEC);
        size_t len = strlen(argv[6]);
        if (len > 0 && len < sizeof boot) {
            memcpy(boot, argv[6], len);
            boot_len = (ssize_t)len;
        }
    }
    /* The daemon decides when this ends (it unmounts, or closes the channel): a Ctrl-C
     * meant for a foreground `weenv mount` must not cut its devices off first. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    struct rlimit files;
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
        files.rlim_cur = files.rlim_max;
        setrlimit(RLIMIT_NOFILE, &files);
    }
    load_map(map_fd);
#ifdef WEENV_DECODE
    dctx = ZSTD_createDCtx();
    if (dctx == NULL) die("zstd");
    ZSTD_DCtx_setParameter(dctx, ZSTD_d_windowLogMax, 27); /* SPEC.md 5.1's bound */
#endif
    close(map_fd);
    counters = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, counters_fd, 0);
    if (counters == MAP_FAILED) die("mmap counters");
    close(counters_fd);
#ifdef WEENV_DECODE
    counters[C_DECODER] = 1;
#endif
    uint8_t *buf = malloc(BUFFER_SIZE);
    if (!buf) die("memory");
    struct pollfd fds[2] = {{.fd = fuse_fd, .events = POLLIN}, {.fd = channel_fd, .events = POLLIN}};
    for (;;) {
        flush_records(); /* about to wait: what was served reaches the daemon now */
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR))
            while (take_chunks()) {} /* all of them: a read may need any */
        if (!(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        /* Several requests in a row without waiting, then the channel again. */
        for (int burst = 0; burst < 64; burst++) {
            ssize_t n = read(fuse_fd, buf, BUFFER_SIZE);
            if (n < 0) {
                if (errno == ENOENT || errno == EINTR) continue; /* interrupted request */
                if (errno == EAGAIN) break;
                if (errno == ENODEV) return 0;                   /* unmounted */
                die("read /dev/fuse");
            }
            handle(buf, (size_t)n);
            struct pollfd more = {.fd = fuse_fd, .events = POLLIN};
            if (poll(&more, 1, 0) <= 0) break;
        }
    }
}
