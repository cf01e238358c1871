// nnrand's C++ replay layer (see replay.py for the protocol).
//
// A routed aten op's Python kernel pays the dispatcher's trip into Python on every call (its arguments
// boxed into Python objects and back) before it does any work of its own. This layer sits above that
// kernel, at the same dispatch key. Per call signature (dtypes, devices, shapes, strides, the low 8 bits
// of every tensor argument's address, the other arguments' values, the stream, the deterministic-mode
// flag) it keeps a plan: the aten calls and kernel launches one Python call made for that signature,
// recorded by replay.py. A call with a known signature runs its plan here (aten ops through the dispatcher, kernels
// through cuLaunchKernel on the current stream), without Python and without the GIL. Anything else goes to
// the Python kernel: a new signature (the second such call is recorded), a signature whose recording
// was refused, a stream being captured into a CUDA graph, calls made from inside an original kernel, and
// every call while Python asks for them all. While Python observes routed calls (nnrand.trace recording
// routed ops), a replayed call then hands its outputs and arguments to the observer, under the GIL.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Context.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

namespace py = pybind11;
using Stack = torch::jit::Stack;

// ---- the driver entry points, resolved at run time (no CUDA headers or libraries at build time) ----

using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**);
using StreamIsCapturing = int (*)(void*, int*);
using GetErrorName = int (*)(int, const char**);

struct Driver {
  LaunchKernel launch = nullptr;
  StreamIsCapturing capturing = nullptr;
  GetErrorName error_name = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      r.launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
      r.capturing = reinterpret_cast<StreamIsCapturing>(dlsym(lib, "cuStreamIsCapturing"));
      r.error_name = reinterpret_cast<GetErrorName>(dlsym(lib, "cuGetErrorName"));
    }
    return r;
  }();
  return d;
}

// ---- plans ----

struct OpStep {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;               // every argument; the tensor ones filled per call
  std::vector<std::pair<int, int>> tensors;     // (argument position, register; -1: None)
  std::vector<int> outs;                        // register per returned value (-1: not kept)
  // the kernel registered for ``op`` before the routing's (called with the call's dispatch keys), or
  // nullptr: ``op`` through the dispatcher
  const c10::SafeKernelFunction* original = nullptr;
};

struct LaunchStep {
  void* fn = nullptr;                           // CUfunction
  unsigned dims[6] = {1, 1, 1, 1, 1, 1};        // grid, block
  unsigned shared_mem = 0;
  std::vector<int64_t> slots;                   // one 8-byte parameter slot per kernel argument
  std::vector<std::pair<int, int>> pointers;    // (slot, register): the register's data pointer per call
  std::string name;
};

struct Step {
  std::unique_ptr<OpStep> op;                   // exactly one of the two
  std::unique_ptr<LaunchStep> launch;
};

struct Plan {
  int64_t id = 0;
  int registers = 0;
  std::vector<std::pair<int, int>> inputs;      // (argument position, register)
  std::vector<std::pair<int, at::Tensor>> constants;
  std::vector<Step> steps;
  std::vector<int> outputs;                     // register per returned value (-1: an undefined tensor)
  bool launches = false;
  std::atomic<int64_t> hits{0};
  int64_t reported = 0;
};

struct Entry {
  std::shared_ptr<Plan> plan;
  int calls = 0;                                // calls that went to Python for this signature
};

constexpr int kWarmCalls = 1;                   // Python calls before the first recording (planning)
constexpr int kMaxCalls = 4;                    // after this many without a plan: Python for good
constexpr size_t kMaxEntries = 4096;            // signatures kept per op (beyond: Python, nothing kept)

struct OpState {
  std::string name;
  c10::OperatorHandle handle;
  c10::SafeKernelFunction python;
  std::optional<c10::SafeKernelFunction> original;   // captured before the routing registered its kernel
  size_t arguments = 0;
  size_t returns = 0;
  std::unordered_map<std::string, Entry> entries;
  int64_t python_calls = 0;
  int64_t recorded = 0;
  int64_t refused = 0;
  int64_t index = 0;                            // in Layer::ops (the op of a record the trace sink takes)
};

struct Layer {
  std::unique_ptr<torch::Library> library;
  std::vector<std::unique_ptr<OpState>> ops;
  bool cuda = false;
  std::mutex mutex;
  std::atomic<bool> python_only{false};
  std::atomic<bool> observing{false};           // replayed calls go to g_observer too
};

// Python's observer of routed calls, called (op, outputs, arguments) after each replayed call while the
// layer is observing; set and read with the GIL held (a Python object, it is no part of Layer, which a
// call on another thread may be the last to release, without the GIL)
PyObject* g_observer = nullptr;

// The enabled layer. Each registered kernel holds the layer too, so a call still running on another thread
// when Python disables it keeps its state alive until it returns.
std::shared_ptr<Layer> g_layer;

struct Pending {
  OpState* op;
  std::shared_ptr<Plan> committed;
  bool skipped = false;                         // Python did not record (another thread was recording)
};

thread_local std::vector<Pending*> t_pending;
thread_local int t_inside = 0;                  // depth of original kernels running on this thread

// An original kernel running on this thread (from Python, or from a plan): the routed ops it dispatches
// itself go to torch's kernels, as on the Python path (routing._Original).
struct Inside {
  Inside() { ++t_inside; }
  ~Inside() { --t_inside; }
};

// ---- the call signature ----

template <typename T>
void put(std::string& k, T v) {
  k.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

bool put_scalar_list(std::string& k, const c10::IValue& v) {
  if (v.isIntList()) {
    k.push_back('l');
    put(k, static_cast<int64_t>(v.toIntList().size()));
    for (int64_t x : v.toIntList()) put(k, x);
    return true;
  }
  if (v.isBoolList()) {
    k.push_back('m');
    put(k, static_cast<int64_t>(v.toBoolList().size()));
    for (bool x : v.toBoolList()) k.push_back(x ? '1' : '0');
    return true;
  }
  if (v.isDoubleList()) {
    k.push_back('f');
    put(k, static_cast<int64_t>(v.toDoubleList().size()));
    for (double x : v.toDoubleList()) put(k, x);
    return true;
  }
  return false;
}

// false: an argument this layer does not key (the call goes to Python)
bool signature(const Stack& stack, size_t arguments, std::string& k, c10::Device& device, bool& have_device) {
  k.reserve(512);
  const c10::StorageImpl* storages[16];         // of the tensor arguments so far: which share memory
  int64_t offsets[16];
  int tensors = 0;
  for (size_t i = stack.size() - arguments; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        k.push_back('u');
        continue;
      }
      if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return false;
      k.push_back(t.requires_grad() ? 'G' : 'T');
      put(k, static_cast<int8_t>(t.scalar_type()));
      put(k, static_cast<int8_t>(t.device().type()));
      put(k, static_cast<int8_t>(t.device().index()));
      put(k, static_cast<int8_t>(t.dim()));
      for (int64_t s : t.sizes()) put(k, s);
      for (int64_t s : t.strides()) put(k, s);
      // the address's low 8 bits: a launcher may pick a kernel by alignment (vector loads), up to 256 bytes
      k.push_back(static_cast<char>(reinterpret_cast<uintptr_t>(t.data_ptr()) & 255));
      // the first earlier tensor argument on the same storage (a recorded call's buffers are told apart
      // by object and by address: a plan made where two arguments share memory fits only such calls)
      if (tensors == 16) return false;
      const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
      int8_t same = -1;
      for (int j = 0; j < tensors; ++j) {
        if (storages[j] == st) {
          same = static_cast<int8_t>(j);
          break;
        }
      }
      put(k, same);
      if (same >= 0) {   // where in the shared memory each lies
        put(k, offsets[same]);
        put(k, t.storage_offset());
      }
      storages[tensors] = st;
      offsets[tensors++] = t.storage_offset();
      if (!have_device) {
        device = t.device();
        have_device = true;
      }
    } else if (v.isNone()) {
      k.push_back('n');
    } else if (v.isInt()) {
      k.push_back('i');
      put(k, v.toInt());
    } else if (v.isDouble()) {
      k.push_back('d');
      put(k, v.toDouble());
    } else if (v.isBool()) {
      k.push_back(v.toBool() ? 'B' : 'b');
    } else if (!put_scalar_list(k, v)) {
      return false;
    }
    k.push_back('|');
  }
  return have_device;
}

void* current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

// ---- running a plan ----

std::string driver_error(int rc) {
  const char* name = nullptr;
  if (driver().error_name != nullptr) driver().error_name(rc, &name);
  return name != nullptr ? std::string(name) : "CUDA driver error " + std::to_string(rc);
}

void run(const Plan& p, Stack& stack, size_t arguments, const c10::Device& device, void* stream,
         c10::DispatchKeySet ks) {
  std::vector<at::Tensor> regs(p.registers);
  const size_t base = stack.size() - arguments;
  for (const auto& [arg, r] : p.inputs) regs[r] = stack[base + arg].toTensor();
  for (const auto& [r, t] : p.constants) regs[r] = t;
  std::optional<c10::DeviceGuard> guard;
  if (p.launches) guard.emplace(device);     // the driver launches into the current device's context
  for (const Step& s : p.steps) {
    if (s.op) {
      Stack local = s.op->args;
      for (const auto& [pos, r] : s.op->tensors) local[pos] = r >= 0 ? c10::IValue(regs[r]) : c10::IValue();
      if (s.op->original != nullptr) {
        Inside inside;
        s.op->original->callBoxed(s.op->op, ks, &local);
      } else {
        s.op->op.callBoxed(&local);
      }
      for (size_t i = 0; i < s.op->outs.size() && i < local.size(); ++i) {
        if (s.op->outs[i] >= 0) regs[s.op->outs[i]] = local[i].toTensor();
      }
    } else {
      const LaunchStep& l = *s.launch;
      std::vector<int64_t> slots = l.slots;
      for (const auto& [slot, r] : l.pointers) slots[slot] = reinterpret_cast<int64_t>(regs[r].data_ptr());
      std::vector<void*> params(slots.size());
      for (size_t i = 0; i < slots.size(); ++i) params[i] = &slots[i];
      const int rc = driver().launch(l.fn, l.dims[0], l.dims[1], l.dims[2], l.dims[3], l.dims[4], l.dims[5],
                                     l.shared_mem, stream, params.data(), nullptr);
      TORCH_CHECK(rc == 0, "nnrand replay: launching kernel ", l.name, " with grid (", l.dims[0], ", ", l.dims[1],
                  ", ", l.dims[2], "), block (", l.dims[3], ", ", l.dims[4], ", ", l.dims[5], "), ", l.shared_mem,
                  " bytes of dynamic shared memory failed: ", driver_error(rc));
    }
  }
  torch::jit::drop(stack, arguments);
  for (int r : p.outputs) stack.emplace_back(r >= 0 ? c10::IValue(regs[r]) : c10::IValue(at::Tensor()));
}

// Hand a replayed call's outputs (the top ``returns`` of ``stack``; one value alone, not in a tuple) and its
// arguments to the observer, as the Python kernel does (routing._bind_observed). An exception it raises
// goes to the caller as that Python exception.
void notify(const std::string& op, const Stack& stack, size_t returns, const std::vector<c10::IValue>& args) {
  py::gil_scoped_acquire gil;
  if (g_observer == nullptr) return;   // stopped meanwhile
  try {
    const py::object observer = py::reinterpret_borrow<py::object>(g_observer);   // alive through the call
    py::object out;
    if (returns == 1) {
      out = torch::jit::toPyObject(stack.back());
    } else {
      py::tuple outs(returns);
      for (size_t i = 0; i < returns; ++i) outs[i] = torch::jit::toPyObject(stack[stack.size() - returns + i]);
      out = std::move(outs);
    }
    py::tuple a(args.size());
    for (size_t i = 0; i < args.size(); ++i) a[i] = torch::jit::toPyObject(args[i]);
    observer(op, out, a);
  } catch (py::error_already_set& e) {
    e.restore();
    python_error err;
    err.persist();   // fetched now, under the GIL: it may be rethrown on another thread (autograd's)
    throw err;
  }
}

// ---- the native record path of nnrand.trace (ops="routed" with a model) ----
//
// While a trace recorder of routed ops is the only observer, a replayed call does not go to Python: its
// outputs are recorded here, as trace.Recorder._observe records them, and the recorder takes the records
// when it next needs its own order (Sink.take in replay.py): a row per recorded output, queued in call
// order. A forward call's outputs are fingerprinted at once (one fingerprint_batch launch per call), a
// backward call's when its pass ends (a callback queued with autograd's engine calls the recorder, which
// launches them), their storages held and their version counters watched meanwhile. A call whose outputs this
// path cannot take (a CPU tensor, a dtype the kernel does not take, a non-contiguous output, a stream the
// recorder has not given fingerprint buffers for) goes to Python's observer instead.

// weak references to autograd nodes, whichever pointer torch holds them by
template <typename P>
struct WeakOf;
template <typename T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
  static type make(const std::shared_ptr<T>& p) { return type(p); }
  static bool is(const type& w, const void* p) { return w.lock().get() == p; }
  static bool expired(const type& w) { return w.expired(); }
};
template <typename T>
struct WeakOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
  static type make(const c10::intrusive_ptr<T>& p) { return type(p); }
  static bool is(const type& w, const void* p) { return w.lock().get() == p; }
  static bool expired(const type& w) { return w.expired(); }
};
using NodePtr = std::decay_t<decltype(torch::autograd::get_current_node())>;
using NodeWeak = WeakOf<NodePtr>;
using torch::autograd::Node;

constexpr int kFpThreads = 256;                  // FP_THREADS (kernels/fingerprint.cu)
constexpr int64_t kFpWordsPerBlock = 256 * 64;   // FP_THREADS * FP_WORDS_PER_THREAD (nnrand/trace.py)
constexpr int64_t kFpMaxBlocks = 1024;           // FP_MAX_BLOCKS
constexpr size_t kFpBatch = 96;                  // FP_BATCH
constexpr int64_t kFpScratchBlocks = 16 * 1024;  // FP_SCRATCH_BLOCKS
constexpr int64_t kHeldBytes = int64_t(1) << 30; // HELD_BYTES
constexpr int64_t kSlotRows = 4096;              // _Slots.ROWS

// the fingerprint kernel's kind code of a dtype (trace.FP_KINDS), -1: none
int fp_kind(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return 0;
    case c10::kInt: return 1;
    case c10::kDouble: return 2;
    case c10::kLong: return 3;
    case c10::kHalf: return 4;
    case c10::kBFloat16: return 5;
    case c10::kShort: return 6;
    case c10::kByte: return 7;
    case c10::kBool: return 7;
    case c10::kChar: return 8;
    default: return -1;
  }
}

int64_t fp_blocks(int64_t n) {   // trace.fp_blocks
  const int64_t b = (n + kFpWordsPerBlock - 1) / kFpWordsPerBlock;
  return b < 1 ? 1 : b < kFpMaxBlocks ? b : kFpMaxBlocks;
}

int64_t fp_chunk(int64_t n, int64_t blocks) { return ((n + blocks - 1) / blocks + 3) & ~int64_t(3); }   // trace.fp_chunk

struct FpStream {                                // trace._FpState of one (device, stream)
  void* fn = nullptr;                            // fingerprint_batch (CUfunction)
  int64_t parts[5] = {0, 0, 0, 0, 0};            // its pointer arguments after the batch
};

struct Waiting {                                 // trace._Deferred: one stream's batch waiting for its launch
  std::vector<int64_t> desc;                     // FpDesc's five words per tensor
  std::vector<c10::Storage> held;
  std::vector<std::tuple<c10::VariableVersion, uint32_t, int64_t>> watched;   // (counter, version, row)
  int64_t blocks = 0;
  int64_t nbytes = 0;
};

// a record: the call (its number among the sink's calls), the op (index in the layer's ops; a snapshot's:
// -1 - the recorder's number of its op), the module (index into the recorder's names), the phase (0: the
// recorder's current one, 1: backward, 2: other), the output number, the shape (index into the sink's
// shapes), the dtype (ScalarType), the device and its slot row
constexpr int kRowFields = 9;

struct Sink {
  std::mutex mutex;
  std::atomic<bool> active{false};                // the recorder takes calls now (not paused or capturing)
  std::atomic<bool> shared{false};                // another observer came: every call to Python, for good
  int64_t waiting_bytes = 0;                      // storage held by the waiting batches
  bool defer_backward = true;
  int64_t unnamed = 0;                           // the module index of "" (no module)
  std::unordered_map<const c10::TensorImpl*, int64_t> owners;   // a parameter -> its module
  std::vector<at::Tensor> owned;                 // (alive while recording: no address reused)
  std::unordered_map<const void*, std::pair<NodeWeak::type, int64_t>> tags;   // a node -> its module
  int64_t stack_top = -1;                        // the recorder's module stack's top (-1: empty)
  std::map<std::pair<int, void*>, FpStream> fp;
  std::map<int, std::vector<at::Tensor>> slot_chunks;
  std::map<int, int64_t> slot_used;
  std::vector<int64_t> rows;                     // kRowFields per record, taken by take()
  int64_t calls = 0;                             // calls recorded so far (every take included)
  int64_t calls_taken = 0;                       // of which taken
  int64_t row_count = 0;                         // rows recorded so far
  std::vector<std::vector<int64_t>> shapes;
  std::map<std::vector<int64_t>, int64_t> shape_ids;
  size_t shapes_taken = 0;
  std::set<std::pair<int, void*>> launched;      // streams that launched since the last take
  std::map<std::pair<int, void*>, Waiting> waiting;
  std::vector<int64_t> failed;                   // rows whose tensor was written before its launch
  std::set<int64_t> tasks;                       // graph tasks whose end calls the recorder
  PyObject* pass_ended = nullptr;                // Python: called (task) at those ends; GIL held to touch
  int64_t recorded_calls = 0, declined_calls = 0;
  // the recorder's codes, as it gives them (sink_code): a take whose records all have theirs comes coded
  std::unordered_map<int64_t, std::pair<int64_t, int64_t>> pair_codes;   // (op, module) packed -> codes
  std::vector<int64_t> shape_codes;              // per shape number (-1: none yet)
  std::unordered_map<int64_t, int64_t> dtype_codes;
  int64_t phase_codes[3] = {-1, -1, -1};         // the recorder's current phase, backward, other
};

int64_t pair_key(int64_t op, int64_t module) { return op * (int64_t(1) << 32) + module; }

std::shared_ptr<Sink> g_sink;

// launch one stream's waiting batch and check its watched tensors (the sink's mutex held)
void launch_waiting(Sink& s, const std::pair<int, void*>& where, Waiting& w, bool checked) {
  if (w.held.empty()) return;
  const FpStream& f = s.fp.at(where);
  std::vector<int64_t> batch(1 + 5 * kFpBatch, 0);
  batch[0] = static_cast<int64_t>(w.desc.size() / 5);
  std::copy(w.desc.begin(), w.desc.end(), batch.begin() + 1);
  int64_t parts[5];
  std::copy(f.parts, f.parts + 5, parts);
  void* params[6] = {batch.data(), &parts[0], &parts[1], &parts[2], &parts[3], &parts[4]};
  c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(where.first)));
  const int rc = driver().launch(f.fn, static_cast<unsigned>(w.blocks), 1, 1, kFpThreads, 1, 1, 0, where.second,
                                 params, nullptr);
  TORCH_CHECK(rc == 0, "nnrand.trace: launching fingerprint_batch (", w.blocks, " blocks) failed: ",
              driver_error(rc));
  s.launched.insert(where);
  s.waiting_bytes -= w.nbytes;
  if (checked) {
    for (const auto& [counter, version, row] : w.watched) {
      if (counter.current_version() != version) s.failed.push_back(row);
    }
  }
  w = Waiting();
}

// Outputs fingerprinted at once on one stream: up to FP_BATCH tensors and FP_SCRATCH_BLOCKS blocks a launch.
struct Now {
  Sink& s;
  std::pair<int, void*> where;
  Waiting w;
  void add(int64_t ptr, int64_t n, int64_t chunk, int64_t out, int64_t blocks, int64_t kind) {
    if (w.desc.size() == 5 * kFpBatch || w.blocks + blocks > kFpScratchBlocks) launch();
    w.desc.insert(w.desc.end(), {ptr, n, chunk, out, w.blocks | blocks << 32 | kind << 48});
    w.blocks += blocks;
    w.held.emplace_back();   // (a launch needs one; the caller holds the tensors until it returns)
  }
  void launch() { launch_waiting(s, where, w, false); }
};

int64_t shape_id(Sink& s, c10::IntArrayRef sizes) {
  std::vector<int64_t> v(sizes.begin(), sizes.end());
  auto it = s.shape_ids.find(v);
  if (it != s.shape_ids.end()) return it->second;
  const int64_t id = static_cast<int64_t>(s.shapes.size());
  s.shapes.push_back(v);
  s.shape_ids.emplace(std::move(v), id);
  return id;
}

int64_t slot_ptr(Sink& s, const c10::Device& device, int64_t& row) {
  const int index = device.index();
  int64_t& used = s.slot_used[index];
  auto& chunks = s.slot_chunks[index];
  const size_t chunk = static_cast<size_t>(used / kSlotRows);
  if (chunk == chunks.size()) {
    chunks.push_back(at::empty({kSlotRows, 3}, at::TensorOptions().dtype(at::kDouble).device(device)));
  }
  row = used++;
  return reinterpret_cast<int64_t>(chunks[chunk].data_ptr()) + 24 * (row % kSlotRows);
}

// the module of a parameter among ``args``, or of the leaf whose gradient one of ``edges`` accumulates
// (through autocast copies): trace.Recorder._owner
int64_t owner(const Sink& s, const std::vector<c10::IValue>& args, const Node* node) {
  for (const c10::IValue& a : args) {
    if (!a.isTensor()) continue;
    auto it = s.owners.find(a.toTensor().unsafeGetTensorImpl());
    if (it != s.owners.end()) return it->second;
  }
  std::vector<const Node*> nexts;
  if (node != nullptr) {
    for (const auto& e : node->next_edges()) nexts.push_back(e.function.get());
  } else {
    for (const c10::IValue& a : args) {
      if (a.isTensor() && a.toTensor().defined() && a.toTensor().grad_fn()) {
        nexts.push_back(a.toTensor().grad_fn().get());
      }
    }
  }
  for (size_t i = 0; i < nexts.size(); ++i) {
    const Node* fn = nexts[i];
    if (fn != nullptr && fn->name().rfind("ToCopyBackward", 0) == 0) {
      for (const auto& e : fn->next_edges()) nexts.push_back(e.function.get());
    }
  }
  for (const Node* fn : nexts) {
    const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(fn);
    if (acc == nullptr) continue;
    auto it = s.owners.find(acc->variable.unsafeGetTensorImpl());
    if (it != s.owners.end()) return it->second;
  }
  return s.unnamed;
}

void queue_pass_end(const std::shared_ptr<Sink>& sink, int64_t task) {
  torch::autograd::Engine::get_default_engine().queue_callback([sink, task]() {
    {
      std::lock_guard<std::mutex> lock(sink->mutex);
      sink->tasks.erase(task);
    }
    py::gil_scoped_acquire gil;
    if (sink->pass_ended == nullptr) return;   // the recording ended meanwhile
    try {
      py::reinterpret_borrow<py::object>(sink->pass_ended)(task);
    } catch (py::error_already_set& e) {
      e.restore();
      python_error err;
      err.persist();
      throw err;
    }
  });
}

// Record a replayed call's outputs (the top ``returns`` of ``stack``) if this path can; false: it cannot,
// and nothing was recorded (the call goes to Python's observer).
bool sink_record(const std::shared_ptr<Sink>& sink, int64_t op, const std::string& name, const Stack& stack,
                 size_t returns, const std::vector<c10::IValue>& args, const c10::Device& device, void* stream) {
  Sink& s = *sink;
  const auto where = std::make_pair(static_cast<int>(device.index()), stream);
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.active.load(std::memory_order_relaxed) || s.shared.load(std::memory_order_relaxed) || !s.fp.count(where)) {
    ++s.declined_calls;
    return false;
  }
  const size_t first = stack.size() - returns;
  for (size_t k = 0; k < returns; ++k) {   // every output this path takes, or none
    const c10::IValue& v = stack[first + k];
    if (!v.isTensor()) {
      if (v.isNone()) continue;
      ++s.declined_calls;
      return false;
    }
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_meta() ||
        t.numel() == 0) {
      continue;   // no record (trace._recordable)
    }
    if (!t.is_cuda() || t.device() != device || fp_kind(t.scalar_type()) < 0 || !t.is_contiguous()) {
      ++s.declined_calls;
      return false;
    }
  }
  const auto node = torch::autograd::get_current_node();
  int64_t module = -1;
  int64_t task = -1;
  if (node) {
    auto it = s.tags.find(node.get());
    if (it != s.tags.end()) {
      if (NodeWeak::is(it->second.first, node.get())) {
        if (it->second.second != s.unnamed) module = it->second.second;
      } else {
        s.tags.erase(it);   // a dead node's tag: its address was reused
      }
    }
    if (module < 0) module = owner(s, args, node.get());
    if (s.defer_backward) task = torch::autograd::get_current_graph_task_id();
    if (task >= 0 && name.back() != '_') {   // an output that is an argument: recorded at once (in-place, out=)
      for (size_t k = 0; k < returns && task >= 0; ++k) {
        const c10::IValue& v = stack[first + k];
        if (!v.isTensor() || !v.toTensor().defined()) continue;
        for (const c10::IValue& a : args) {
          if (a.isTensor() && a.toTensor().unsafeGetTensorImpl() == v.toTensor().unsafeGetTensorImpl()) {
            task = -1;
            break;
          }
        }
      }
    } else {
      task = -1;
    }
  } else {
    module = s.stack_top >= 0 ? s.stack_top : owner(s, args, nullptr);
  }
  const int64_t call = s.calls++;
  ++s.recorded_calls;
  Now now{s, where};
  for (size_t k = 0; k < returns; ++k) {
    const c10::IValue& v = stack[first + k];
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_meta() ||
        t.numel() == 0) {
      continue;
    }
    int64_t row = 0;
    const int64_t out = slot_ptr(s, device, row);
    const int64_t n = t.numel();
    const int64_t blocks = fp_blocks(n);
    const int64_t chunk = fp_chunk(n, blocks);
    const int64_t kind = fp_kind(t.scalar_type());
    const int64_t seq = s.row_count++;
    if (task >= 0) {
      Waiting& w = s.waiting[where];
      if (s.waiting_bytes > kHeldBytes) {   // HELD_BYTES over every stream's batch, as the Python path holds
        for (auto& [other, ow] : s.waiting) launch_waiting(s, other, ow, true);
      } else if (w.held.size() == kFpBatch || w.blocks + blocks > kFpScratchBlocks) {
        launch_waiting(s, where, w, true);
      }
      w.desc.insert(w.desc.end(), {reinterpret_cast<int64_t>(t.data_ptr()), n, chunk, out,
                                   w.blocks | blocks << 32 | kind << 48});
      w.held.push_back(t.storage());
      const auto& counter = t.unsafeGetTensorImpl()->version_counter();
      if (counter.enabled()) w.watched.emplace_back(counter, counter.current_version(), seq);
      w.blocks += blocks;
      w.nbytes += static_cast<int64_t>(t.storage().nbytes());
      s.waiting_bytes += static_cast<int64_t>(t.storage().nbytes());
      if (s.tasks.insert(task).second) queue_pass_end(sink, task);
    } else {
      now.add(reinterpret_cast<int64_t>(t.data_ptr()), n, chunk, out, blocks, kind);
    }
    s.rows.insert(s.rows.end(), {call, op, module, node ? 1 : 0, static_cast<int64_t>(k),
                                 shape_id(s, t.sizes()), static_cast<int64_t>(t.scalar_type()),
                                 static_cast<int64_t>(device.index()), row});
  }
  now.launch();
  return true;
}

std::mutex g_sink_mutex;   // guards g_sink itself (set from Python, read by calls on any thread)

std::shared_ptr<Sink> current_sink() {
  std::lock_guard<std::mutex> lock(g_sink_mutex);
  return g_sink;
}

// ---- the kernel registered above the Python one ----

struct ReplayKernel final : public c10::OperatorKernel {
  OpState* state;
  std::shared_ptr<Layer> layer;
  ReplayKernel(OpState* s, std::shared_ptr<Layer> l) : state(s), layer(std::move(l)) {}

  void python(const c10::OperatorHandle& op, c10::DispatchKeySet ks, Stack* stack) {
    state->python.callBoxed(op, ks, stack);
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, Stack* stack) {
    const std::shared_ptr<Layer> keep = layer;   // alive for this call, whatever Python does meanwhile
    if (t_inside > 0 || layer->python_only.load(std::memory_order_relaxed)) return python(op, ks, stack);
    std::string key;
    c10::Device device(c10::kCPU);
    bool have_device = false;
    if (!signature(*stack, state->arguments, key, device, have_device)) return python(op, ks, stack);
    void* stream = nullptr;
    if (layer->cuda) {
      if (device.type() != c10::kCUDA || driver().launch == nullptr) return python(op, ks, stack);
      stream = current_stream(device);
      int status = 0;
      // a capture records what Python does (graph-private ticket counters); an error reads as capturing
      if (driver().capturing == nullptr || driver().capturing(stream, &status) != 0 || status != 0) {
        return python(op, ks, stack);
      }
      put(key, reinterpret_cast<uintptr_t>(stream));
    }
    // the global flags a handler may read (the tuner's candidate set, torch's deterministic kernels)
    const auto& ctx = at::globalContext();
    key.push_back(static_cast<char>(ctx.deterministicAlgorithms() | ctx.deterministicCuDNN() << 1 |
                                    ctx.benchmarkCuDNN() << 2 | ctx.userEnabledCuDNN() << 3 |
                                    c10::GradMode::is_enabled() << 4 | c10::InferenceMode::is_enabled() << 5));

    std::shared_ptr<Plan> plan;
    int calls = 0;
    {
      std::lock_guard<std::mutex> lock(layer->mutex);
      auto it = state->entries.find(key);
      if (it != state->entries.end()) {
        plan = it->second.plan;
        calls = it->second.calls;
      } else if (state->entries.size() >= kMaxEntries) {
        calls = kMaxCalls;   // no room for another signature: Python, without an entry
      }
    }
    if (plan) {
      if (layer->observing.load(std::memory_order_relaxed)) {
        const std::vector<c10::IValue> args(stack->end() - state->arguments, stack->end());
        run(*plan, *stack, state->arguments, device, stream, ks);
        plan->hits.fetch_add(1, std::memory_order_relaxed);
        const std::shared_ptr<Sink> sink = current_sink();
        if (sink && sink_record(sink, state->index, state->name, *stack, state->returns, args, device, stream)) {
          return;
        }
        notify(state->name, *stack, state->returns, args);
        return;
      }
      run(*plan, *stack, state->arguments, device, stream, ks);
      plan->hits.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (calls >= kMaxCalls || calls < kWarmCalls) {
      python(op, ks, stack);
      std::lock_guard<std::mutex> lock(layer->mutex);
      auto it = state->entries.find(key);
      if (it != state->entries.end()) {
        ++it->second.calls;
      } else if (state->entries.size() < kMaxEntries) {
        ++state->entries[key].calls;
      }
      ++state->python_calls;
      return;
    }
    Pending pending{state, nullptr};
    t_pending.push_back(&pending);
    try {
      python(op, ks, stack);
    } catch (...) {
      t_pending.pop_back();
      throw;
    }
    t_pending.pop_back();
    std::lock_guard<std::mutex> lock(layer->mutex);
    Entry& e = state->entries[key];
    ++state->python_calls;
    if (pending.skipped) return;   // not an attempt: another thread was recording
    ++e.calls;
    if (pending.committed) {
      if (!e.plan) e.plan = std::move(pending.committed);   // two threads recording one signature: the first
      ++state->recorded;
    } else {
      ++state->refused;
    }
  }
};

// ---- the Python side ----

std::pair<std::string, std::string> split_name(const std::string& qualified) {
  const auto dot = qualified.find('.');
  if (dot == std::string::npos) return {qualified, ""};
  return {qualified.substr(0, dot), qualified.substr(dot + 1)};
}

// The kernels registered now for ``ops`` at ``key``, taken by the next enable(): called before the routing
// registers its own, they are the originals a plan may call (a configuration passed on to torch).
std::vector<std::pair<std::string, c10::SafeKernelFunction>> g_captured;
std::string g_captured_at;                      // "namespace/key" of what g_captured holds

void capture(const std::vector<std::string>& ops, const std::string& ns, const std::string& key) {
  g_captured.clear();   // a capture no layer took (a routing that failed before enabling it) is dropped
  g_captured_at = ns + "/" + key;
  const c10::DispatchKey k = c10::parseDispatchKey(key);
  for (const std::string& name : ops) {
    const auto [base, overload] = split_name(name);
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + base).c_str(), overload.c_str());
    // the computed kernel: the key's own, or one a composite registration fills in (aten::convolution)
    try {
      g_captured.emplace_back(name, handle.getComputedKernelForDispatchKey(k));
    } catch (const c10::Error&) {   // none at this key: calls passed on to it are not replayed
    }
  }
}

// "Overriding a previously registered kernel": that is the point
struct Quiet final : public c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

void enable(const std::vector<std::string>& ops, const std::string& ns, const std::string& key) {
  // what capture() took is this layer's or nobody's, whatever happens below
  const auto originals = std::move(g_captured);
  g_captured.clear();
  const bool ours = g_captured_at == ns + "/" + key;
  TORCH_CHECK(!g_layer, "nnrand replay: the layer is already enabled");
  Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  auto layer = std::make_shared<Layer>();
  const c10::DispatchKey k = c10::parseDispatchKey(key);
  layer->cuda = k == c10::DispatchKey::CUDA;
  for (const std::string& name : ops) {
    const auto [base, overload] = split_name(name);
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + base).c_str(), overload.c_str());
    auto state = std::unique_ptr<OpState>(new OpState{name, handle, handle.getComputedKernelForDispatchKey(k)});
    state->arguments = handle.schema().arguments().size();
    state->returns = handle.schema().returns().size();
    state->index = static_cast<int64_t>(layer->ops.size());
    for (auto& [captured, kernel] : originals) {
      if (ours && captured == name) state->original.emplace(kernel);
    }
    layer->ops.push_back(std::move(state));
  }
  layer->library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, k, __FILE__, __LINE__);
  for (auto& s : layer->ops) {
    const auto [base, overload] = split_name(s->name);
    const std::string reg = overload.empty() ? base : base + "." + overload;
    auto kernel = std::make_unique<ReplayKernel>(s.get(), layer);
    layer->library->impl(reg.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(kernel)));
  }
  g_layer = std::move(layer);
}

// The ops whose kernels capture() holds for the next enable().
std::vector<std::string> captured() {
  std::vector<std::string> out;
  for (auto& [name, kernel] : g_captured) out.push_back(name);
  return out;
}

void clear_captured() { g_captured.clear(); }

void disable() {
  if (!g_layer) return;
  std::shared_ptr<Layer> layer = std::move(g_layer);
  g_layer.reset();
  layer->python_only.store(true);   // a call still running elsewhere goes on in Python
  layer->observing.store(false);
  PyObject* old = g_observer;       // (called from Python: the GIL is held)
  g_observer = nullptr;             // cleared before the release, which may run Python
  Py_XDECREF(old);
  layer->library.reset();           // the kernels below (Python's) are the dispatcher's again
}

bool enabled() { return static_cast<bool>(g_layer); }

// Whether this thread's innermost call is a recording miss of ``op`` (the Python kernel then records).
bool pending(const std::string& op) { return !t_pending.empty() && t_pending.back()->op->name == op; }

void set_python_only(bool on) {
  if (g_layer) g_layer->python_only.store(on);
}

// ``observer(op, outputs, arguments)`` after every replayed call from now on; None: no more. (Calls that go
// to Python are the Python kernel's to report.) Called with the GIL held, as the kernels read it.
void set_observer(py::object observer) {
  PyObject* old = g_observer;
  g_observer = observer.is_none() ? nullptr : observer.release().ptr();
  if (g_layer) g_layer->observing.store(g_observer != nullptr);
  Py_XDECREF(old);
}

// This thread's pending miss is not recorded and not counted as an attempt (another thread records).
void skip() {
  if (!t_pending.empty()) t_pending.back()->skipped = true;
}

void enter_original() { ++t_inside; }
void leave_original() { --t_inside; }
bool inside() { return t_inside > 0; }

// A constant argument. A Python number where the schema takes a tensor is what Python's argument parser
// makes of it (``y * 0.5``): a wrapped-number CPU tensor, which type promotion treats as a scalar.
c10::IValue argument(const c10::Argument& a, const py::handle& v) {
  if (a.type()->kind() == c10::TypeKind::TensorType &&
      (py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))) {
    const c10::Scalar s = py::isinstance<py::bool_>(v)    ? c10::Scalar(v.cast<bool>())
                          : py::isinstance<py::int_>(v)   ? c10::Scalar(v.cast<int64_t>())
                                                          : c10::Scalar(v.cast<double>());
    at::Tensor t = at::scalar_to_tensor(s);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  return torch::jit::toIValue(v, a.type());
}

// Attach a recorded plan to this thread's pending miss. ``steps``: ("op", name, overload, entries, outs) with
// one entry per schema argument: ("r", register) a tensor register, ("n",) None, ("d",) the default,
// ("v", value) a constant; or ("launch", function, dims, shared_mem, slots, pointers, name).
void commit(const std::string& op, int64_t id, int registers, const std::vector<std::pair<int, int>>& inputs,
            const std::vector<std::pair<int, at::Tensor>>& constants, const py::list& steps,
            const std::vector<int>& outputs) {
  TORCH_CHECK(!t_pending.empty() && t_pending.back()->op->name == op, "nnrand replay: no pending call of ", op);
  OpState* state = t_pending.back()->op;
  TORCH_CHECK(outputs.size() == state->returns, "nnrand replay: ", op, " returns ", state->returns,
              " values, the plan gives ", outputs.size());
  auto plan = std::make_shared<Plan>();
  plan->id = id;
  plan->registers = registers;
  plan->inputs = inputs;
  plan->constants = constants;
  plan->outputs = outputs;
  for (const py::handle& h : steps) {
    const py::tuple s = py::reinterpret_borrow<py::tuple>(h);
    const std::string kind = s[0].cast<std::string>();
    Step step;
    if (kind == "op" || kind == "original") {
      const std::string name = s[1].cast<std::string>();
      const std::string overload = s[2].cast<std::string>();
      const c10::SafeKernelFunction* original = nullptr;
      std::optional<c10::OperatorHandle> found;
      if (kind == "original") {   // the recorded op's own kernel from before the routing's, as captured
        OpState* own = t_pending.back()->op;
        TORCH_CHECK(own->name == name && own->original, "nnrand replay: no original kernel of ", name,
                    " was captured for this call");
        original = &*own->original;
        found.emplace(own->handle);
      } else {
        found.emplace(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()));
      }
      const c10::OperatorHandle handle = *found;
      const auto& schema = handle.schema();
      const py::list entries = s[3].cast<py::list>();
      TORCH_CHECK(entries.size() == schema.arguments().size(), "nnrand replay: ", name, " takes ",
                  schema.arguments().size(), " arguments, the plan gives ", entries.size());
      auto o = std::unique_ptr<OpStep>(new OpStep{handle});
      for (size_t i = 0; i < entries.size(); ++i) {
        const py::tuple e = entries[i].cast<py::tuple>();
        const std::string tag = e[0].cast<std::string>();
        const c10::Argument& a = schema.arguments()[i];
        if (tag == "r") {
          o->args.emplace_back();
          o->tensors.emplace_back(static_cast<int>(i), e[1].cast<int>());
        } else if (tag == "n") {
          o->args.emplace_back();
        } else if (tag == "d") {
          TORCH_CHECK(a.default_value().has_value(), "nnrand replay: ", name, " argument ", a.name(),
                      " has no default");
          o->args.push_back(*a.default_value());
        } else {
          o->args.push_back(argument(a, e[1]));
        }
      }
      o->outs = s[4].cast<std::vector<int>>();
      o->original = original;
      step.op = std::move(o);
    } else {
      auto l = std::make_unique<LaunchStep>();
      l->fn = reinterpret_cast<void*>(s[1].cast<uintptr_t>());
      const auto dims = s[2].cast<std::vector<unsigned>>();
      TORCH_CHECK(dims.size() == 6, "nnrand replay: a launch needs grid and block (6 numbers)");
      std::copy(dims.begin(), dims.end(), l->dims);
      l->shared_mem = s[3].cast<unsigned>();
      l->slots = s[4].cast<std::vector<int64_t>>();
      l->pointers = s[5].cast<std::vector<std::pair<int, int>>>();
      l->name = s[6].cast<std::string>();
      if (l->slots.empty()) l->slots.push_back(0);
      plan->launches = true;
      step.launch = std::move(l);
    }
    plan->steps.push_back(std::move(step));
  }
  t_pending.back()->committed = std::move(plan);
}

// (plan id, calls replayed since the last take) for every plan that ran
std::vector<std::pair<int64_t, int64_t>> take_counts() {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!g_layer) return out;
  std::lock_guard<std::mutex> lock(g_layer->mutex);
  for (auto& s : g_layer->ops) {
    for (auto& [key, e] : s->entries) {
      if (!e.plan) continue;
      const int64_t n = e.plan->hits.load();
      if (n != e.plan->reported) {
        out.emplace_back(e.plan->id, n - e.plan->reported);
        e.plan->reported = n;
      }
    }
  }
  return out;
}

// per op: signatures, plans, replayed calls, calls that went to Python, recordings made and refused
py::dict stats() {
  py::dict out;
  if (!g_layer) return out;
  std::lock_guard<std::mutex> lock(g_layer->mutex);
  for (auto& s : g_layer->ops) {
    int64_t plans = 0, hits = 0;
    for (auto& [key, e] : s->entries) {
      if (e.plan) {
        ++plans;
        hits += e.plan->hits.load();
      }
    }
    py::dict d;
    d["signatures"] = s->entries.size();
    d["plans"] = plans;
    d["replayed"] = hits;
    d["python"] = s->python_calls;
    d["recorded"] = s->recorded;
    d["refused"] = s->refused;
    out[py::str(s->name)] = d;
  }
  return out;
}


// ---- the native record path: the recorder's side (called from Python, the GIL held) ----

// Start recording replayed calls here. ``pass_ended(task)``: called at the end of each backward pass that
// left records waiting; ``unnamed``: the module index of ""; ``owners``: (parameter, module index). Returns
// the layer's ops (a record's op is an index into them).
std::vector<std::string> sink_start(py::object pass_ended, int64_t unnamed,
                                    const std::vector<std::pair<at::Tensor, int64_t>>& owners, bool defer_backward) {
  TORCH_CHECK(g_layer, "nnrand replay: the trace sink needs the enabled layer");
  std::vector<std::string> ops;
  for (const auto& op : g_layer->ops) ops.push_back(op->name);
  auto s = std::make_shared<Sink>();
  s->unnamed = unnamed;
  s->defer_backward = defer_backward;
  for (const auto& [t, m] : owners) {
    s->owners[t.unsafeGetTensorImpl()] = m;
    s->owned.push_back(t);
  }
  s->pass_ended = pass_ended.release().ptr();
  s->active.store(true);
  std::shared_ptr<Sink> old;
  {
    std::lock_guard<std::mutex> lock(g_sink_mutex);
    old = std::move(g_sink);
    g_sink = std::move(s);
  }
  if (old) {
    old->active.store(false);
    PyObject* cb = old->pass_ended;
    old->pass_ended = nullptr;
    Py_XDECREF(cb);
  }
  return ops;
}

void sink_stop() {
  std::shared_ptr<Sink> old;
  {
    std::lock_guard<std::mutex> lock(g_sink_mutex);
    old = std::move(g_sink);
    g_sink.reset();
  }
  if (!old) return;
  old->active.store(false);
  PyObject* cb = old->pass_ended;
  old->pass_ended = nullptr;   // a pass-end callback still queued finds none
  Py_XDECREF(cb);
}

std::shared_ptr<Sink> sink_or_throw() {
  auto s = current_sink();
  TORCH_CHECK(s, "nnrand replay: no trace recording takes replayed calls");
  return s;
}

// Whether replayed calls are recorded here (true) or handed to the Python observer (false).
void sink_active(bool on) {
  auto s = current_sink();
  if (s) s->active.store(on);
}

// Another observer came (routing.observe): replayed calls go to Python's observers from now on.
void sink_share() {
  auto s = current_sink();
  if (s) s->shared.store(true);
}

// The fingerprint kernel and its buffers for launches on ``stream`` of device ``index`` (trace._fp_state).
void sink_fp(int index, uintptr_t stream, uintptr_t fn, const std::vector<int64_t>& parts) {
  TORCH_CHECK(parts.size() == 5, "nnrand replay: fingerprint_batch takes 5 buffer addresses, got ", parts.size());
  auto s = current_sink();
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  FpStream& f = s->fp[{index, reinterpret_cast<void*>(stream)}];
  f.fn = reinterpret_cast<void*>(fn);
  std::copy(parts.begin(), parts.end(), f.parts);
}

// The module index of the recorder's module stack's top (-1: the stack is empty).
void sink_stack(int64_t top) {
  auto s = current_sink();
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  s->stack_top = top;
}

// ``module`` as the module of ``t``'s autograd node unless one was set (trace._tag).
void sink_tag(const at::Tensor& t, int64_t module) {
  auto s = current_sink();
  if (!s || !t.defined()) return;
  const auto& fn = t.grad_fn();
  if (!fn) return;
  std::lock_guard<std::mutex> lock(s->mutex);
  auto it = s->tags.find(fn.get());
  if (it != s->tags.end()) {
    if (NodeWeak::is(it->second.first, fn.get())) return;
    s->tags.erase(it);   // a dead node's tag: its address was reused
  }
  s->tags.emplace(fn.get(), std::make_pair(NodeWeak::make(fn), module));
}

// The records since the last take: (first call number, calls, first row number, rows as int64 bytes
// (kRowFields each), the shapes new since the last take, the (device, stream) pairs that launched, the
// rows found written before their launch, each device's slot rows since the last take with ``values_too``
// (a tensor per device index; the slots then start again), the rows coded (step ``step``, the index of the
// first call ``index_base``; None unless the recorder gave every code, see sink_code), the records' one
// device (-1: several) and their slot rows as int64 bytes). ``launch``: first launch every waiting batch
// (``checked``: with the version check).
py::tuple sink_take(bool launch, bool values_too, bool checked, int64_t step, int64_t index_base) {
  const auto sink = sink_or_throw();
  Sink& s = *sink;
  std::vector<int64_t> rows;
  std::vector<int64_t> coded;
  std::vector<int64_t> slots_of;
  int64_t device = -2;                           // the records' one device (-1: several)
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::pair<int, uintptr_t>> launched;
  std::vector<int64_t> failed;
  py::dict values;
  int64_t first_call, calls, first_row;
  std::vector<std::pair<int, std::vector<at::Tensor>>> slots;
  {
    // the GIL let go while the mutex is held: a record holding the mutex may need it (an allocation whose
    // memory history takes Python stacks)
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(s.mutex);
    if (launch) {
      for (auto& [where, w] : s.waiting) launch_waiting(s, where, w, checked);
      s.waiting.clear();
    }
    rows.swap(s.rows);
    first_call = s.calls_taken;
    calls = s.calls - s.calls_taken;
    s.calls_taken = s.calls;
    first_row = s.row_count - static_cast<int64_t>(rows.size() / kRowFields);
    shapes.assign(s.shapes.begin() + static_cast<int64_t>(s.shapes_taken), s.shapes.end());
    s.shapes_taken = s.shapes.size();
    // the rows as the recorder keeps them (step, phase, index, op, module, output, shape, dtype), where it
    // gave the codes of every record's op, module, shape and dtype; their slot rows
    const size_t n = rows.size() / kRowFields;
    coded.reserve(8 * n);
    slots_of.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t* r = &rows[kRowFields * i];
      const auto pc = s.pair_codes.find(pair_key(r[1], r[2]));
      const auto dc = s.dtype_codes.find(r[6]);
      const int64_t shape = r[5] < static_cast<int64_t>(s.shape_codes.size()) ? s.shape_codes[r[5]] : -1;
      if (pc == s.pair_codes.end() || dc == s.dtype_codes.end() || shape < 0 || s.phase_codes[r[3]] < 0) {
        coded.clear();
        break;
      }
      coded.insert(coded.end(), {step, s.phase_codes[r[3]], index_base + r[0] - first_call, pc->second.first,
                                 pc->second.second, r[4], shape, dc->second});
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t* r = &rows[kRowFields * i];
      slots_of.push_back(r[8]);
      device = device == -2 || device == r[7] ? r[7] : -1;
    }
    for (const auto& [index, stream] : s.launched) launched.emplace_back(index, reinterpret_cast<uintptr_t>(stream));
    s.launched.clear();
    failed.swap(s.failed);
    if (values_too) {   // the chunks written, the last cut to its rows (joined in Python after the streams)
      for (auto& [index, used] : s.slot_used) {
        if (used == 0) continue;
        const auto& chunks = s.slot_chunks[index];
        std::vector<at::Tensor> parts;
        for (int64_t at = 0; at < used; at += kSlotRows) {
          const at::Tensor& c = chunks[static_cast<size_t>(at / kSlotRows)];
          parts.push_back(used - at >= kSlotRows ? c : c.narrow(0, 0, used - at));
        }
        slots.emplace_back(index, std::move(parts));
        used = 0;
      }
      for (auto it = s.tags.begin(); it != s.tags.end();) {   // the tags of nodes gone since
        it = NodeWeak::expired(it->second.first) ? s.tags.erase(it) : std::next(it);
      }
    }
  }
  for (const auto& [index, parts] : slots) values[py::int_(index)] = parts;
  const bool all_coded = !rows.empty() && coded.size() == 8 * (rows.size() / kRowFields);
  return py::make_tuple(first_call, calls, first_row,
                        py::bytes(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(int64_t)),
                        shapes, launched, failed, values,
                        all_coded ? py::object(py::bytes(reinterpret_cast<const char*>(coded.data()),
                                                         coded.size() * sizeof(int64_t)))
                                  : py::object(py::none()),
                        device, py::bytes(reinterpret_cast<const char*>(slots_of.data()),
                                          slots_of.size() * sizeof(int64_t)));
}

// The recorder's codes: ``kind`` 0: of op and module (``key`` = op * 2^32 + module) ``a`` and ``b``; 1: of
// shape number ``key``, ``a``; 2: of dtype ``key``, ``a``; 3: of phase ``key`` (0: its current one), ``a``.
void sink_code(int kind, int64_t key, int64_t a, int64_t b) {
  const auto sink = sink_or_throw();
  Sink& s = *sink;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (kind == 0) {
    s.pair_codes[key] = {a, b};
  } else if (kind == 1) {
    TORCH_CHECK(key >= 0, "nnrand replay: shape number ", key);
    if (static_cast<int64_t>(s.shape_codes.size()) <= key) s.shape_codes.resize(key + 1, -1);
    s.shape_codes[key] = a;
  } else if (kind == 2) {
    s.dtype_codes[key] = a;
  } else {
    TORCH_CHECK(kind == 3 && key >= 0 && key < 3, "nnrand replay: sink_code(", kind, ", ", key, ")");
    s.phase_codes[key] = a;
  }
}

// A snapshot (trace.Recorder.snapshot): a record of each of ``ts`` (phase other, op -1 - ``op``, module
// ``modules[i]``), each its own call, fingerprinted now on the current stream. False, and nothing recorded,
// where the sink is off or one is no contiguous CUDA tensor of the first one's device that the kernel takes,
// or the stream has no fingerprint buffers.
bool sink_snapshot(const std::vector<at::Tensor>& ts, int64_t op, const std::vector<int64_t>& modules) {
  TORCH_CHECK(ts.size() == modules.size(), "nnrand replay: a snapshot of ", ts.size(), " tensors with ",
              modules.size(), " modules");
  auto sink = current_sink();
  if (!sink || ts.empty() || !sink->active.load() || sink->shared.load()) return false;
  Sink& s = *sink;
  const c10::Device device = ts[0].device();
  if (!device.is_cuda()) return false;
  for (const at::Tensor& t : ts) {
    if (!t.defined() || t.device() != device || t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() ||
        fp_kind(t.scalar_type()) < 0 || !t.is_contiguous() || t.numel() == 0) {
      return false;
    }
  }
  const auto where = std::make_pair(static_cast<int>(device.index()), current_stream(device));
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.fp.count(where)) return false;
  c10::DeviceGuard guard(device);
  Now now{s, where};
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    int64_t row = 0;
    const int64_t out = slot_ptr(s, device, row);
    const int64_t n = t.numel();
    const int64_t blocks = fp_blocks(n);
    now.add(reinterpret_cast<int64_t>(t.data_ptr()), n, fp_chunk(n, blocks), out, blocks, fp_kind(t.scalar_type()));
    s.rows.insert(s.rows.end(), {s.calls++, -1 - op, modules[i], 2, 0, shape_id(s, t.sizes()),
                                 static_cast<int64_t>(t.scalar_type()), static_cast<int64_t>(device.index()), row});
    ++s.row_count;
  }
  now.launch();
  return true;
}

py::dict sink_stats() {
  py::dict out;
  auto s = current_sink();
  if (!s) return out;
  int64_t counts[3];
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(s->mutex);
    counts[0] = s->recorded_calls;
    counts[1] = s->declined_calls;
    counts[2] = s->row_count;
  }
  out["recorded"] = counts[0];
  out["declined"] = counts[1];
  out["rows"] = counts[2];
  return out;
}

// ``t``'s dtype as the sink's records give it (its ScalarType's number).
int sink_dtype(const at::Tensor& t) { return static_cast<int>(t.scalar_type()); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("capture", &capture);
  m.def("enable", &enable);
  m.def("disable", &disable);
  m.def("enabled", &enabled);
  m.def("pending", &pending);
  m.def("set_python_only", &set_python_only);
  m.def("set_observer", &set_observer);
  m.def("skip", &skip);
  m.def("enter_original", &enter_original);
  m.def("leave_original", &leave_original);
  m.def("inside", &inside);
  m.def("captured", &captured);
  m.def("clear_captured", &clear_captured);
  m.def("commit", &commit);
  m.def("take_counts", &take_counts);
  m.def("stats", &stats);
  m.def("sink_start", &sink_start);
  m.def("sink_stop", &sink_stop);
  // (the GIL let go inside: see sink_take)
  m.def("sink_active", &sink_active, py::call_guard<py::gil_scoped_release>());
  m.def("sink_share", &sink_share, py::call_guard<py::gil_scoped_release>());
  m.def("sink_fp", &sink_fp, py::call_guard<py::gil_scoped_release>());
  m.def("sink_stack", &sink_stack, py::call_guard<py::gil_scoped_release>());
  m.def("sink_tag", &sink_tag, py::call_guard<py::gil_scoped_release>());
  m.def("sink_take", &sink_take);
  m.def("sink_stats", &sink_stats);
  m.def("sink_snapshot", &sink_snapshot, py::call_guard<py::gil_scoped_release>());
  m.def("sink_code", &sink_code, py::call_guard<py::gil_scoped_release>());
  m.def("sink_dtype", &sink_dtype);
}
