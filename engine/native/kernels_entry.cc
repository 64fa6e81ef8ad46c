// The library's entry points: ONNX Runtime's registration of the `npuchat` op domain (QMatMul,
// Attention, RopeAttention) and, for `npuchat doctor`, which kernel table this process runs.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <mutex>

#include "qblocks.h"

const OrtCustomOp* npuchat_qmatmul_op();         // qmatmul_op.cc
const OrtCustomOp* npuchat_attention_op();       // attention_op.cc
const OrtCustomOp* npuchat_rope_attention_op();  // rope_attention_op.cc
const OrtCustomOp* npuchat_rope_attention_f16_op();

extern "C" {

// ONNX Runtime's entry point for SessionOptions.register_custom_ops_library.
__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an older runtime: the session fails on the unknown op
  Ort::InitApi(api);
  static OrtCustomOpDomain* domain = nullptr;
  static std::once_flag once;
  OrtStatus* status = nullptr;
  std::call_once(once, [&] {
    status = api->CreateCustomOpDomain("npuchat", &domain);
    for (const OrtCustomOp* op :
         {npuchat_qmatmul_op(), npuchat_attention_op(), npuchat_rope_attention_op(),
          npuchat_rope_attention_f16_op()}) {
      if (status == nullptr) status = api->CustomOpDomain_Add(domain, op);
    }
  });
  if (status != nullptr) return status;
  return api->AddCustomOpDomain(options, domain);
}

// Which kernels this process uses (avx512vnni, avxvnni, avx2, scalar), for `npuchat doctor`.
__attribute__((visibility("default"))) const char* npuchat_kernel_isa() {
  return npq::chosen_kernels().isa;
}

}  // extern "C"
