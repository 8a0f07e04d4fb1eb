// The data plane's frame pump (moshpeer/averaging/frame_pump.py): a run of frames written, or read and checked, in
// one call, with the GIL released (torch ops run without it). A frame is a 24-byte header, its payload and a 16-byte
// tag. The tags are not computed here: `handshake.FrameAuth` computes every frame's (AES-256-GCM through
// `cryptography`, whose bundled OpenSSL ran GMAC at 3x the speed of the system's libcrypto 3.0 on the 2-core host:
// docs/benchmarks.md), so the sender passes a run's tags in and the reader hands them out, with the headers, to be
// verified before any payload is used.
#include <ATen/core/Tensor.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kHeaderBytes = 24;  // wire.HEADER: "!4sBBHII8s"
constexpr int kTagBytes = 16;
constexpr int kGroupTagBytes = 8;
constexpr int kPhaseEndReduce = 3;
constexpr int kPhaseEndGather = 4;

// What a read returns besides frames (frame_pump.py maps these to its exceptions; > 0 is an errno).
constexpr int64_t kOk = 0, kBadHeader = -1, kOtherRound = -2, kOversized = -3, kEndWithPayload = -4, kClosed = -6;

void check_bytes(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() >= numel, what,
              " must be at least ", numel, " contiguous uint8 CPU bytes");
}

uint32_t read_be(const uint8_t* p, int bytes) {
  uint32_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  return v;
}

// Write all of `iov` (advancing it past partial writes). -> 0, or the errno that stopped it; `sent` counts bytes.
int write_all(int fd, std::vector<iovec>& iov, int64_t& sent) {
  size_t first = 0;
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = count;
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    sent += n;
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return 0;
}

// Frames k = 0..n-1: header k (headers[24k:24k+24]), payload data[offsets[k]:offsets[k]+lengths[k]] and tag k
// (tags[16k:16k+16]), written in as few syscalls as the socket takes. The socket's own timeouts (wire.block_until)
// bound the call. -> [frames written whole, 0 or the errno that stopped the writing].
std::vector<int64_t> send_frames(int64_t fd, const at::Tensor& headers, const at::Tensor& data, const at::Tensor& tags,
                                 at::IntArrayRef offsets, at::IntArrayRef lengths) {
  const int64_t n = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == n, "one length per offset");
  check_bytes(headers, n * kHeaderBytes, "headers");
  check_bytes(tags, n * kTagBytes, "tags");
  check_bytes(data, 0, "data");
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(offsets[k] >= 0 && lengths[k] >= 0 && offsets[k] + lengths[k] <= data.numel(),
                "frame ", k, " lies outside data");
  const uint8_t* header = headers.data_ptr<uint8_t>();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  const uint8_t* tag = tags.data_ptr<uint8_t>();
  std::vector<iovec> iov;
  iov.reserve(static_cast<size_t>(n) * 3);
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t* h = header + k * kHeaderBytes;
    const uint8_t* p = bytes + offsets[k];
    uint8_t* t = const_cast<uint8_t*>(tag + k * kTagBytes);
    iov.push_back({const_cast<uint8_t*>(h), static_cast<size_t>(kHeaderBytes)});
    if (lengths[k] > 0) iov.push_back({const_cast<uint8_t*>(p), static_cast<size_t>(lengths[k])});
    iov.push_back({t, static_cast<size_t>(kTagBytes)});
  }
  int64_t sent = 0;
  const int error = write_all(static_cast<int>(fd), iov, sent);
  int64_t whole = 0;
  for (int64_t k = 0, end = 0; k < n; ++k) {
    end += kHeaderBytes + lengths[k] + kTagBytes;
    if (end <= sent) whole = k + 1;
  }
  return {whole, error};
}

// Read exactly `size` bytes. -> 0, kClosed on EOF, or an errno (EAGAIN once the socket's timeout expired).
int64_t read_exactly(int fd, uint8_t* out, int64_t size) {
  int64_t got = 0;
  while (got < size) {
    const ssize_t n = recv(fd, out + got, static_cast<size_t>(size - got), MSG_WAITALL);
    if (n == 0) return kClosed;
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    got += n;
  }
  return 0;
}

// Read frames until one of: `free_rows` payloads were received (rows first_row.. of `rows`, `row_stride` bytes
// apart), an end marker was read (it is the last frame returned), a frame of another phase than `phase` (0: the first
// frame's) was read (the last returned), or the connection stayed quiet `idle_ms` after at least one frame. The first
// frame waits as long as the socket's timeout allows. Every frame is checked (magic, version, phase, the round's
// 8-byte tag, size); its header and tag go to headers[24k:] and tags[16k:] (room for free_rows + 1 frames: the rows'
// and an end marker), for the caller to verify its MAC before it uses the payload.
// -> [status, frames, then phase, part, chunk, payload_len per frame]; status 0, an errno, or a negative code above
// (frames read before the failure passed these checks and are returned).
std::vector<int64_t> recv_frames(int64_t fd, const at::Tensor& round_tag, int64_t version, at::Tensor rows,
                                 int64_t row_stride, int64_t first_row, int64_t free_rows, int64_t max_payload,
                                 int64_t phase, int64_t idle_ms, at::Tensor headers, at::Tensor tags) {
  TORCH_CHECK(round_tag.numel() == kGroupTagBytes, "round_tag must be 8 bytes");
  check_bytes(round_tag, kGroupTagBytes, "round_tag");
  check_bytes(rows, 0, "rows");
  TORCH_CHECK(free_rows >= 1 && first_row >= 0 && max_payload <= row_stride &&
                  (first_row + free_rows) * row_stride <= rows.numel(), "rows too small for the frames asked for");
  check_bytes(headers, (free_rows + 1) * kHeaderBytes, "headers");
  check_bytes(tags, (free_rows + 1) * kTagBytes, "tags");
  std::vector<int64_t> out = {kOk, 0};
  const int sock = static_cast<int>(fd);
  const uint8_t* expected_tag = round_tag.data_ptr<uint8_t>();
  uint8_t* row_base = rows.data_ptr<uint8_t>();
  int64_t received = 0;
  for (int64_t frames = 0;; ++frames) {
    if (frames > 0) {  // more only while they keep coming: a pause means the sender has a slice to encode
      pollfd quiet{sock, POLLIN, 0};
      int ready;
      do ready = poll(&quiet, 1, static_cast<int>(idle_ms));
      while (ready < 0 && errno == EINTR);
      if (ready == 0) break;
    }
    uint8_t* header = headers.data_ptr<uint8_t>() + frames * kHeaderBytes;
    int64_t status = read_exactly(sock, header, kHeaderBytes);
    if (status != 0) {
      out[0] = status;
      break;
    }
    const int64_t frame_phase = header[5];
    const int64_t payload_len = read_be(header + 12, 4);
    if (std::memcmp(header, "MSHP", 4) != 0 || header[4] != version || frame_phase < 1 || frame_phase > 4) {
      out[0] = kBadHeader;
      break;
    }
    if (std::memcmp(header + 16, expected_tag, kGroupTagBytes) != 0) {
      out[0] = kOtherRound;
      break;
    }
    if (payload_len > max_payload) {
      out[0] = kOversized;
      break;
    }
    const bool end = frame_phase == kPhaseEndReduce || frame_phase == kPhaseEndGather;
    if (end && payload_len != 0) {
      out[0] = kEndWithPayload;
      break;
    }
    uint8_t* payload = end ? nullptr : row_base + (first_row + received) * row_stride;
    if (!end && (status = read_exactly(sock, payload, payload_len)) != 0) {
      out[0] = status;
      break;
    }
    if ((status = read_exactly(sock, tags.data_ptr<uint8_t>() + frames * kTagBytes, kTagBytes)) != 0) {
      out[0] = status;
      break;
    }
    out[1] += 1;
    out.insert(out.end(), {frame_phase, read_be(header + 6, 2), read_be(header + 8, 4), payload_len});
    if (end) break;
    received += 1;
    if (phase == 0) phase = frame_phase;
    if (frame_phase != phase || received == free_rows) break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moshpeer_cpu, m) {
  m.def("send_frames(int fd, Tensor headers, Tensor data, Tensor tags, int[] offsets, int[] lengths) -> int[]",
        &send_frames);
  m.def("recv_frames(int fd, Tensor round_tag, int version, Tensor(a!) rows, int row_stride, int first_row, "
        "int free_rows, int max_payload, int phase, int idle_ms, Tensor(b!) headers, Tensor(c!) tags) -> int[]",
        &recv_frames);
}
