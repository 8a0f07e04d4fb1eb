// The data plane's frame pump (moshpeer/averaging/frame_pump.py): a run of frames MAC'd and written, or read and
// checked, in one call, with the GIL released (torch ops run without it). A frame is a 24-byte header, its payload
// and a 16-byte tag: AES-256-GCM under the connection's frame key, the frame's sequence number (12 bytes, little
// endian) as nonce, the header as the message (its ciphertext discarded) and the payload as associated data
// (handshake.FrameAuth computes the same tags with `cryptography`). The MAC is OpenSSL's libcrypto, opened at run
// time: building needs no OpenSSL headers, and a machine without libcrypto falls back to the Python frame path.
#include <ATen/core/Tensor.h>
#include <dlfcn.h>
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
constexpr int kEvpCtrlGcmGetTag = 0x10;  // EVP_CTRL_GCM_GET_TAG (== EVP_CTRL_AEAD_GET_TAG)

// What a read returns besides frames (frame_pump.py maps these to its exceptions; > 0 is an errno).
constexpr int64_t kOk = 0, kBadHeader = -1, kOtherRound = -2, kOversized = -3, kEndWithPayload = -4,
                  kMacMismatch = -5, kClosed = -6, kNoCrypto = -7;

// The libcrypto functions the MAC needs; their ABI is the same in OpenSSL 1.1 and 3.
struct Crypto {
  void* (*ctx_new)() = nullptr;
  void (*ctx_free)(void*) = nullptr;
  const void* (*aes_256_gcm)() = nullptr;
  int (*init)(void*, const void*, void*, const unsigned char*, const unsigned char*) = nullptr;
  int (*update)(void*, unsigned char*, int*, const unsigned char*, int) = nullptr;
  int (*final)(void*, unsigned char*, int*) = nullptr;
  int (*ctrl)(void*, int, int, void*) = nullptr;
  bool ok = false;
};

const Crypto& crypto() {
  static const Crypto loaded = [] {
    Crypto c;
    void* lib = nullptr;
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"})
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (lib == nullptr) return c;
    c.ctx_new = reinterpret_cast<void* (*)()>(dlsym(lib, "EVP_CIPHER_CTX_new"));
    c.ctx_free = reinterpret_cast<void (*)(void*)>(dlsym(lib, "EVP_CIPHER_CTX_free"));
    c.aes_256_gcm = reinterpret_cast<const void* (*)()>(dlsym(lib, "EVP_aes_256_gcm"));
    c.init = reinterpret_cast<decltype(c.init)>(dlsym(lib, "EVP_EncryptInit_ex"));
    c.update = reinterpret_cast<decltype(c.update)>(dlsym(lib, "EVP_EncryptUpdate"));
    c.final = reinterpret_cast<decltype(c.final)>(dlsym(lib, "EVP_EncryptFinal_ex"));
    c.ctrl = reinterpret_cast<decltype(c.ctrl)>(dlsym(lib, "EVP_CIPHER_CTX_ctrl"));
    c.ok = c.ctx_new && c.ctx_free && c.aes_256_gcm && c.init && c.update && c.final && c.ctrl;
    return c;
  }();
  return loaded;
}

// AES-256-GCM tags of one connection's frames (one key schedule, a fresh nonce per frame).
class FrameMac {
 public:
  explicit FrameMac(const uint8_t* key) : c_(crypto()) {
    if (!c_.ok) return;
    ctx_ = c_.ctx_new();
    ok_ = ctx_ != nullptr && c_.init(ctx_, c_.aes_256_gcm(), nullptr, key, nullptr) == 1;
  }
  ~FrameMac() {
    if (ctx_ != nullptr) c_.ctx_free(ctx_);
  }
  FrameMac(const FrameMac&) = delete;
  FrameMac& operator=(const FrameMac&) = delete;

  bool ok() const { return ok_; }

  bool tag(const uint8_t* header, const uint8_t* payload, int64_t payload_len, uint64_t sequence, uint8_t* out) {
    uint8_t nonce[12] = {0};
    for (int i = 0; i < 8; ++i) nonce[i] = static_cast<uint8_t>(sequence >> (8 * i));
    uint8_t discarded[kHeaderBytes + 16];
    int written = 0;
    if (c_.init(ctx_, nullptr, nullptr, nullptr, nonce) != 1) return false;
    while (payload_len > 0) {  // associated data, in pieces that fit EVP's int lengths
      const int piece = payload_len > (1 << 30) ? (1 << 30) : static_cast<int>(payload_len);
      if (c_.update(ctx_, nullptr, &written, payload, piece) != 1) return false;
      payload += piece;
      payload_len -= piece;
    }
    if (c_.update(ctx_, discarded, &written, header, kHeaderBytes) != 1) return false;
    if (c_.final(ctx_, discarded + written, &written) != 1) return false;
    return c_.ctrl(ctx_, kEvpCtrlGcmGetTag, kTagBytes, out) == 1;
  }

 private:
  const Crypto& c_;
  void* ctx_ = nullptr;
  bool ok_ = false;
};

uint32_t read_be(const uint8_t* p, int bytes) {
  uint32_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  return v;
}

bool same_bytes(const uint8_t* a, const uint8_t* b, int n) {  // constant time: a tag comparison
  uint8_t diff = 0;
  for (int i = 0; i < n; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

const uint8_t* key_bytes(const at::Tensor& key) {
  TORCH_CHECK(key.device().is_cpu() && key.scalar_type() == at::kByte && key.is_contiguous() && key.numel() == 32,
              "key must be 32 contiguous uint8 CPU bytes");
  return key.data_ptr<uint8_t>();
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

// Frames k = 0..n-1: header k (headers[24k:24k+24]) and payload data[offsets[k]:offsets[k]+lengths[k]], tagged with
// sequence numbers sequence..sequence+n-1 and written in as few syscalls as the socket takes. The socket's own
// timeouts (wire.block_until) bound the call. -> [frames written whole, 0 or the errno that stopped the writing].
std::vector<int64_t> send_frames(int64_t fd, const at::Tensor& key, int64_t sequence, const at::Tensor& headers,
                                 const at::Tensor& data, at::IntArrayRef offsets, at::IntArrayRef lengths) {
  const int64_t n = static_cast<int64_t>(offsets.size());
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == n, "one length per offset");
  TORCH_CHECK(headers.device().is_cpu() && headers.scalar_type() == at::kByte && headers.is_contiguous() &&
                  headers.numel() == n * kHeaderBytes, "headers must be n * 24 contiguous uint8 CPU bytes");
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.is_contiguous(),
              "data must be contiguous uint8 CPU bytes");
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(offsets[k] >= 0 && lengths[k] >= 0 && offsets[k] + lengths[k] <= data.numel(),
                "frame ", k, " lies outside data");
  FrameMac mac(key_bytes(key));
  if (!mac.ok()) return {0, kNoCrypto};
  const uint8_t* header = headers.data_ptr<uint8_t>();
  const uint8_t* bytes = data.data_ptr<uint8_t>();
  std::vector<uint8_t> tags(static_cast<size_t>(n) * kTagBytes);
  std::vector<iovec> iov;
  iov.reserve(static_cast<size_t>(n) * 3);
  for (int64_t k = 0; k < n; ++k) {
    const uint8_t* h = header + k * kHeaderBytes;
    const uint8_t* p = bytes + offsets[k];
    uint8_t* t = tags.data() + k * kTagBytes;
    if (!mac.tag(h, p, lengths[k], static_cast<uint64_t>(sequence + k), t)) return {0, kNoCrypto};
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
// 8-byte tag, size) and its MAC verified before it is returned.
// -> [status, frames, then phase, part, chunk, payload_len per frame]; status 0, an errno, or a negative code above
// (frames read before the failure are valid and returned).
std::vector<int64_t> recv_frames(int64_t fd, const at::Tensor& key, int64_t sequence, const at::Tensor& round_tag,
                                 int64_t version, at::Tensor rows, int64_t row_stride, int64_t first_row,
                                 int64_t free_rows, int64_t max_payload, int64_t phase, int64_t idle_ms) {
  TORCH_CHECK(round_tag.device().is_cpu() && round_tag.scalar_type() == at::kByte && round_tag.is_contiguous() &&
                  round_tag.numel() == kGroupTagBytes, "round_tag must be 8 uint8 CPU bytes");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kByte && rows.is_contiguous(),
              "rows must be contiguous uint8 CPU bytes");
  TORCH_CHECK(free_rows >= 1 && first_row >= 0 && max_payload <= row_stride &&
                  (first_row + free_rows) * row_stride <= rows.numel(), "rows too small for the frames asked for");
  std::vector<int64_t> out = {kOk, 0};
  FrameMac mac(key_bytes(key));
  if (!mac.ok()) {
    out[0] = kNoCrypto;
    return out;
  }
  const int sock = static_cast<int>(fd);
  const uint8_t* expected_tag = round_tag.data_ptr<uint8_t>();
  uint8_t* row_base = rows.data_ptr<uint8_t>();
  uint8_t header[kHeaderBytes], tag[kTagBytes], computed[kTagBytes];
  int64_t received = 0;
  for (int64_t frames = 0;; ++frames) {
    if (frames > 0) {  // more only while they keep coming: a pause means the sender has a slice to encode
      pollfd quiet{sock, POLLIN, 0};
      int ready;
      do ready = poll(&quiet, 1, static_cast<int>(idle_ms));
      while (ready < 0 && errno == EINTR);
      if (ready == 0) break;
    }
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
    if ((status = read_exactly(sock, tag, kTagBytes)) != 0) {
      out[0] = status;
      break;
    }
    if (!mac.tag(header, payload, payload_len, static_cast<uint64_t>(sequence + frames), computed)) {
      out[0] = kNoCrypto;
      break;
    }
    if (!same_bytes(tag, computed, kTagBytes)) {
      out[0] = kMacMismatch;
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

bool frame_mac_available() {
  const uint8_t key[32] = {0};
  return FrameMac(key).ok();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moshpeer_cpu, m) {
  m.def("send_frames(int fd, Tensor key, int sequence, Tensor headers, Tensor data, int[] offsets, int[] lengths) "
        "-> int[]", &send_frames);
  m.def("recv_frames(int fd, Tensor key, int sequence, Tensor round_tag, int version, Tensor(a!) rows, "
        "int row_stride, int first_row, int free_rows, int max_payload, int phase, int idle_ms) -> int[]",
        &recv_frames);
  m.def("frame_mac_available() -> bool", &frame_mac_available);
}
