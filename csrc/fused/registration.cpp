// The op schemas of the megatron_fused namespace. Bodies are registered per device in
// csrc/fused/<op>/<op>_cpu.cpp (CPU) and csrc/fused/<op>/<op>_cuda.cu (CUDA); autograd is
// added in Python (megatron/fused_kernels/ops.py), whose docstrings give each op's meaning.
#include <Python.h>
#include <torch/library.h>

namespace megatron_fused {

// Bumped whenever a schema or an op's meaning changes, so that Python refuses a stale build.
constexpr int64_t kVersion = 2;

int64_t version() { return kVersion; }

// cpu_convert.cpp: the SIMD clone the CPU bodies run (0 baseline, 1 x86-64-v3, 2 x86-64-v4).
int64_t cpu_isa_level_op();

}  // namespace megatron_fused

TORCH_LIBRARY(megatron_fused, m) {
  m.def("version() -> int", &megatron_fused::version);
  m.def("cpu_isa_level() -> int", &megatron_fused::cpu_isa_level_op);
  m.def("scaled_masked_softmax_fwd(Tensor input, Tensor? mask, float scale) -> Tensor");
  m.def("scaled_masked_softmax_bwd(Tensor grad_output, Tensor output, Tensor? mask, "
        "float scale) -> Tensor");
  m.def("scaled_upper_triang_masked_softmax_fwd(Tensor input, float scale) -> Tensor");
  m.def("scaled_upper_triang_masked_softmax_bwd(Tensor grad_output, Tensor output, "
        "float scale) -> Tensor");
  m.def("layer_norm_fwd(Tensor input, Tensor weight, Tensor? bias, float eps, bool rms) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad_output, Tensor input, Tensor weight, Tensor mean, "
        "Tensor rstd, bool rms) -> (Tensor, Tensor, Tensor)");
  m.def("bias_gelu_fwd(Tensor input, Tensor? bias) -> Tensor");
  m.def("bias_gelu_bwd(Tensor grad_output, Tensor input, Tensor? bias) -> (Tensor, Tensor)");
  m.def("bias_dropout_add_fwd(Tensor input, Tensor? bias, Tensor residual, float prob, "
        "bool training, Generator? generator=None) -> (Tensor, Tensor)");
  m.def("bias_dropout_add_bwd(Tensor grad_output, Tensor rng_state, float prob, bool training, "
        "int bias_numel) -> (Tensor, Tensor)");
  m.def("fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] model_params, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, float step, "
        "bool amsgrad, bool maximize) -> ()");
  m.def("cross_entropy_fwd(Tensor logits, Tensor target, int vocab_start) -> Tensor");
  m.def("cross_entropy_bwd(Tensor logits, Tensor target, Tensor lse, Tensor grad_loss, "
        "int vocab_start, int vocab_size, float smoothing, Tensor(a!) grad_input) -> ()");
}

// Importable as a Python module (megatron.fused_kernels._C) when built by setup.py; importing
// it runs the registrations above. torch.ops.load_library needs no module at all.
#ifdef TORCH_EXTENSION_NAME
#define MEGATRON_CONCAT_(a, b) a##b
#define MEGATRON_CONCAT(a, b) MEGATRON_CONCAT_(a, b)
#define MEGATRON_STR_(a) #a
#define MEGATRON_STR(a) MEGATRON_STR_(a)

static PyModuleDef megatron_fused_module = {
    PyModuleDef_HEAD_INIT, MEGATRON_STR(TORCH_EXTENSION_NAME),
    "Fused CPU/CUDA kernels, registered as torch.ops.megatron_fused.*", -1, nullptr,
    nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC MEGATRON_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&megatron_fused_module);
}
#endif
