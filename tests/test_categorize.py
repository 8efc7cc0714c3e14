"""Kernel names as they appear in public vLLM / SGLang / PyTorch traces and docs."""
import pytest
import yaml

from decodescope import verdict
from decodescope.trace import categorize as cz
from decodescope.trace.categorize import OTHER, categorize_name, demangle

GPU_NAMES = [
    # NCCL all-reduce
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce_nccl"),
    ("ncclDevKernel_AllReduce_Sum_f32_TREE_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce_nccl"),
    ("ncclKernel_AllReduce_RING_LL_Sum_half(ncclWorkElem)", "allreduce_nccl"),
    ("ncclDevKernel_AllReduce_Sum_bf16_NVLS_SIMPLE(ncclDevKernelArgsStorage<4096ul>)", "allreduce_nccl"),
    # custom all-reduce
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)", "allreduce_custom"),
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 4>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)", "allreduce_custom"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 8, 8>(c10::BFloat16**, unsigned long, unsigned long, c10::BFloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)", "allreduce_custom"),
    ("void c10d::symmetric_memory::two_shot_all_reduce_kernel<c10::BFloat16, 8, 4>(c10::BFloat16**, unsigned long, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)", "allreduce_custom"),
    ("void c10d::symmetric_memory::multimem_all_reduce_kernel<c10::BFloat16, 16, 8>(c10::BFloat16*, unsigned long, unsigned int**, unsigned long, unsigned long)", "allreduce_custom"),
    ("void tensorrt_llm::kernels::ar_fusion::allreduce_fusion_kernel_oneshot_lamport<__nv_bfloat16, 8, true>(tensorrt_llm::kernels::ar_fusion::AllReduceFusionParams<__nv_bfloat16>)", "allreduce_custom"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8>(...)", "allreduce_custom"),
    ("void quickreduce::allreduce_prototype_twoshot<quickreduce::CodecFP, true>(...)", "allreduce_custom"),
    # other collectives
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allgather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, int4 const*, float const*, long const*, float const*, bool const*, int const*, int, int, int, int, int, int, int, int, void**, int, int, int)", "ep_dispatch_combine"),
    ("void deep_ep::internode_ll::combine<false>(void*, void*, int*, void*, void const*, long const*, int const*, long const*, int*, int*, int, int, int, int, int, int, int, int, int, int, bool, int)", "ep_dispatch_combine"),
    ("void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int, int const*, int*, int, int, int, int, bool const*, int*, int*, int, int, void**, int**, int)", "ep_dispatch_combine"),
    # attention
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, false, true, true, false, true, true, false, false, false>, flash::CollectiveEpilogueFwd<cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bfloat16_t, cutlass::arch::Sm90, 256, true, true, false, false>, flash::VarlenDynamicPersistentTileScheduler<128, 256, 128, false, true, true> > > >(flash::FlashAttnFwdSm90<...>::Params)", "attention"),
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false, false>(flash::Flash_fwd_params)", "attention"),
    ("void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, 4, 1, true>(flash::Flash_fwd_params)", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 1u, 8u, 16u, 4u, 1u, 8u, flashinfer::DefaultAttention<false, false, false, false>, ...>(...)", "attention"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<...>>(...)", "attention"),
    ("void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512>, true, flash::SharedStorageMLA<Flash_fwd_kernel_traits_mla<576, 64, 64, 8, cutlass::bfloat16_t, 512> > >(Flash_fwd_mla_params)", "attention"),
    ("kernel_unified_attention_2d", "attention"),
    ("kernel_unified_attention_3d", "attention"),
    ("void vllm::paged_attention_v2_kernel<__nv_bfloat16, __nv_bfloat16, 128, 16, 128, (vllm::Fp8KVCacheDataType)0, false, 512>(...)", "attention"),
    ("void vllm::paged_attention_v2_reduce_kernel<__nv_bfloat16, 128, 128, 512>(...)", "attention"),
    ("_fwd_grouped_kernel_stage1", "attention"),
    ("void cutlass::device_kernel<cutlass::fmha::kernel::Sm100FmhaMlaKernelTmaWarpspecialized<...>>(...)", "attention"),
    ("void merge_attn_states_kernel<__nv_bfloat16, 8>(...)", "attention"),
    # KV-cache write
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, long, int, int, int, float const*, float const*)", "kv_cache_write"),
    ("void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)", "kv_cache_write"),
    # dense GEMM
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNN", "gemm_dense"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm_dense"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm_dense"),
    ("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_stage6_warpsize2x2x1_tensor16x8x16_kernel", "gemm_dense"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "gemm_dense"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)", "gemm_dense"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(...)", "gemm_dense"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)", "gemm_dense"),
    # quantized GEMM
    ("void marlin::Marlin<(vllm::ScalarType::Id)5, (vllm::ScalarType::Id)5, (vllm::ScalarType::Id)9, (vllm::ScalarType::Id)5, 256, 1, 8, 8, true, 4, 8, false>(int4 const*, int4 const*, int4*, int4*, int4 const*, int4 const*, uint16_t const*, int4 const*, int const*, int, int, int, int, int, int, int*, bool, bool, bool, int)", "gemm_quantized"),
    ("void machete::MacheteKernelTemplate<...>::kernel(...)", "gemm_quantized"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<...>, cutlass::float_e4m3_t, ...>>>(...)", "gemm_quantized"),
    ("_w8a8_block_fp8_matmul", "gemm_quantized"),
    ("void deep_gemm::fp8_gemm_kernel<4096u, 7168u, 128u, 160u, 128u, 1u, 8u, 128u, 4u, 2u, (deep_gemm::GemmType)0>(...)", "gemm_quantized"),
    # MoE experts
    ("fused_moe_kernel", "moe_experts"),
    ("fused_moe_kernel_gptq_awq", "moe_experts"),
    ("void marlin_moe_wna16::Marlin<(vllm::ScalarType::Id)5, 256, 1, 8, 8, true, 4, 8, false>(...)", "moe_experts"),
    ("void vllm::moe::moe_sum_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16 const*, int)", "moe_experts"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >, ...>>(...)", "moe_experts"),
    # MoE routing
    ("void vllm::moe::topkGatingSoftmax<8, 128, 4, 16, int>(float const*, bool const*, float*, int, int*, int*, int, int, int)", "moe_routing"),
    ("void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, int, int, int, unsigned long, int*)", "moe_routing"),
    ("void vllm::moe::grouped_topk_fused_kernel<__nv_bfloat16>(...)", "moe_routing"),
    ("void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*, int*, int*, unsigned long)", "moe_routing"),
    # norm, rope, activation
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, float, int, int)", "norm"),
    ("void vllm::rms_norm_kernel<c10::BFloat16>(c10::BFloat16*, c10::BFloat16 const*, c10::BFloat16 const*, float, int, int)", "norm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1", "norm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, int, long, long, int, int, int)", "rope"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)", "activation"),
    ("triton_poi_fused_mul_silu_0", "activation"),
    # sampling
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "sampling"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<float, int, int>::Policy800, true, float, int, int, int, at_cuda_detail::cub::detail::identity_decomposer_t>(...)", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>)", "sampling"),
    # memcpy / memset
    ("Memcpy HtoD (Pinned -> Device)", "memcpy_memset"),
    ("Memcpy DtoD (Device -> Device)", "memcpy_memset"),
    ("Memset (Device)", "memcpy_memset"),
    # elementwise
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<int>, at::detail::Array<char*, 1>)", "elementwise_other"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 2, 128, 1>(...)", "elementwise_other"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>(long, ...)", "elementwise_other"),
]

CPU_NAMES = [
    ("_C::shm_allreduce", "allreduce"), ("gloo:all_reduce", "allreduce"), ("c10d::allreduce_", "allreduce"),
    ("vllm::all_reduce", "allreduce"), ("_C::shm_all_gather", "allgather"), ("gloo:broadcast", "collective_other"),
    ("_C::onednn_mm", "gemm"), ("aten::mm", "gemm"), ("aten::linear", "gemm"), ("aten::addmm", "gemm"),
    ("_C::cpu_attention_with_kv_cache", "attention"), ("vllm::unified_attention_with_output", "attention"),
    ("_C::cpu_attn_reshape_and_cache", "kv_cache_write"), ("vllm::unified_kv_cache_update", "kv_cache_write"),
    ("_C::cpu_fused_moe", "moe_experts"), ("aten::topk", "moe_routing"), ("_C::fused_gumbel_argmax", "sampling"),
    ("_C::rms_norm", "norm"), ("_C::fused_add_rms_norm", "norm"), ("_C::rotary_embedding", "rope"),
    ("_C::silu_and_mul", "activation"), ("aten::copy_", "memcpy"), ("aten::slice", "elementwise_other"),
    ("Pregraph bytecode", "framework_overhead"), ("## Call CompiledFxGraph None ##", "framework_overhead"),
]


def test_at_least_sixty_real_gpu_names_are_covered():
    assert len(GPU_NAMES) >= 60


@pytest.mark.parametrize("name,category", GPU_NAMES, ids=[n[:60] for n, _ in GPU_NAMES])
def test_gpu_kernel_category(name, category):
    assert categorize_name(name, "gpu") == category


@pytest.mark.parametrize("name,category", CPU_NAMES, ids=[n for n, _ in CPU_NAMES])
def test_cpu_op_category(name, category):
    assert categorize_name(name, "cpu") == category


def test_flash_attention_through_cutlass_is_attention_not_gemm():
    name = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<...>>>(...)"
    assert categorize_name(name, "gpu") == "attention"


def test_unknown_names_land_in_other():
    assert categorize_name("my_totally_new_kernel_xyz", "gpu") == OTHER
    assert categorize_name("MyCustomOp::forward", "cpu") == OTHER


def test_mangled_names_are_demangled_before_matching():
    mangled = "_ZN4vllm15rms_norm_kernelIN3c108BFloat16EEEvPT_PKS3_S6_fii"
    plain = demangle([mangled])[mangled]
    assert "vllm::rms_norm_kernel" in plain


def test_torch_generic_sort_scan_and_cudnn_sdpa_names_from_an_h200_trace():
    assert categorize_name("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0") == "attention"
    assert categorize_name("void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long, at::native::GTOp<float, true>, unsigned int>(...)") == "elementwise_other"
    # 'uint4' in a template argument is not an int4 GEMM
    assert categorize_name("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<unsigned int, 4, ...>(long, at::PhiloxCudaState, uint4)") == "elementwise_other"


# ---- every communicator vLLM uses for tensor-parallel collectives, waits included -----------------
# (name, device, category, verdict class, where the name comes from). "real trace (torch 2.13 gloo)"
# is a two-rank torch.profiler capture of torch.distributed and its functional collectives on CPU.
_VLLM = "vllm/distributed/device_communicators/"
_SYMM_OPS = "torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu"
COLLECTIVE_NAMES = [
    # NCCL >= 2.27 symmetric-memory kernels (pynccl / ProcessGroupNCCL with NCCL_WIN_ENABLE)
    ("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_f32(ncclSymkDevWorkArgs4K)", "gpu", "allreduce_nccl", "communication",
     "NCCL src/device/symmetric generated kernels"),
    ("ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC_sum_f8e4m3(ncclSymkDevWorkArgs4K)", "gpu", "allreduce_nccl",
     "communication", "NCCL symmetric kernel, demangled from _Z54ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC..."),
    ("ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16", "gpu", "allreduce_nccl", "communication",
     "NCCL symmetric kernel named in vLLM's NCCL symmetric-memory docs"),
    ("ncclSymkDevKernel_AllGather_ST", "gpu", "allgather", "communication", "NCCL symmetric all-gather kernel"),
    # vLLM custom all-reduce (custom_all_reduce.py -> csrc/custom_all_reduce.cuh)
    ("void vllm::cross_device_reduce_1stage<half, 4>(vllm::RankData*, vllm::RankSignals, vllm::Metadata volatile*, half*, int, int)",
     "gpu", "allreduce_custom", "communication", "csrc/custom_all_reduce.cuh (Metadata signature)"),
    ("void vllm::cross_device_reduce_half_butterfly<__nv_bfloat16, 4>(vllm::RankData*, vllm::RankSignals, vllm::Metadata volatile*, __nv_bfloat16*, int, int)",
     "gpu", "allreduce_custom", "communication", "csrc/custom_all_reduce.cuh"),
    # vLLM custom all-gather / reduce-scatter (csrc/custom_all_gather_reduce_scatter.cuh): not all-reduce
    ("void vllm::cross_device_all_gather<8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, vllm::array_t<unsigned long, 2>*, int, int)",
     "gpu", "allgather", "communication", "csrc/custom_all_gather_reduce_scatter.cuh"),
    ("void vllm::cross_device_reduce_scatter<__nv_bfloat16, 8>(vllm::RankData*, vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)",
     "gpu", "reduce_scatter", "communication", "csrc/custom_all_gather_reduce_scatter.cuh"),
    ("void vllm::mnnvl_lamport_all_gather<__nv_bfloat16, 4>(vllm::RankData*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, unsigned int*, int, int, int)",
     "gpu", "allgather", "communication", "csrc/custom_all_gather_reduce_scatter.cuh (lamport, still all-gather)"),
    ("void vllm::mnnvl_lamport_reduce_scatter_kernel<__nv_bfloat16, 4>(vllm::RankData*, __nv_bfloat16 const*, __nv_bfloat16*, unsigned int*, int, int, int)",
     "gpu", "reduce_scatter", "communication", "csrc/custom_all_gather_reduce_scatter.cuh"),
    # quick all-reduce (quick_all_reduce.py, ROCm -> csrc/quickreduce/quick_reduce_impl.cuh)
    ("quickreduce::allreduce_prototype_twoshot<AllReduceTwoshot<__half, CodecQ4<__half,4>, true>, __half>", "gpu",
     "allreduce_custom", "communication", "real trace: public MI355X TP=8 profile report (INT4 codec)"),
    # torch symmetric memory (symm_mem.py -> torch.ops.symm_mem.*)
    ("void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 8>(c10::BFloat16**, c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "gpu", "allreduce_custom", "communication", _SYMM_OPS),
    ("void (anonymous namespace)::two_shot_all_reduce_kernel_inplace<c10::BFloat16, 16, 8>(c10::BFloat16**, unsigned long, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "gpu", "allreduce_custom", "communication", _SYMM_OPS),
    ("void (anonymous namespace)::multimem_one_shot_all_reduce_kernel<c10::BFloat16, 16>(c10::BFloat16*, c10::BFloat16*, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "gpu", "allreduce_custom", "communication", _SYMM_OPS),
    ("void (anonymous namespace)::multimem_all_gather_kernel<16>(char*, char*, unsigned long, unsigned int**, unsigned long, unsigned long)",
     "gpu", "allgather", "communication", _SYMM_OPS),
    ("c10d::symmetric_memory::wait_signal_kernel(unsigned int**, int, int, int, int, unsigned long)", "gpu",
     "collective_wait", "communication", "torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.cu"),
    ("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int, unsigned long)", "gpu",
     "collective_wait", "communication", "torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.cu"),
    # FlashInfer all-reduce (+ fusion) (flashinfer_all_reduce.py, compilation allreduce_rms_fusion.py)
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true, true>(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)",
     "gpu", "allreduce_custom", "communication", "flashinfer include/flashinfer/comm/trtllm_allreduce_fusion.cuh"),
    ("void tensorrt_llm::kernels::twoShotAllReduceKernel<__nv_bfloat16, 8, true, false>(tensorrt_llm::kernels::AllReduceParams)",
     "gpu", "allreduce_custom", "communication", "flashinfer include/flashinfer/comm/trtllm/kernels/customAllReduceKernels.cu"),
    # vLLM's CPU shm communicator (cpu_communicator.py -> csrc/cpu/shm.cpp)
    ("_C::shm_gather", "cpu", "allgather", "communication", _VLLM + "cpu_communicator.py"),
    ("_C::shm_send_tensor_list", "cpu", "send_recv", "communication", _VLLM + "cpu_communicator.py"),
    ("_C::shm_recv_tensor_list", "cpu", "send_recv", "communication", _VLLM + "cpu_communicator.py"),
    # vLLM's custom ops, as CPU ops in every trace
    ("vllm::all_gather", "cpu", "allgather", "communication", "vllm/distributed/parallel_state.py"),
    ("vllm::reduce_scatter", "cpu", "reduce_scatter", "communication", "vllm/distributed/parallel_state.py"),
    ("vllm::outplace_all_reduce", "cpu", "allreduce", "communication", "vllm/compilation/collective_fusion.py (v0.6)"),
    ("vllm::inplace_all_reduce", "cpu", "allreduce", "communication", "vllm/compilation/collective_fusion.py (v0.6)"),
    ("vllm::all_reduce_symmetric_with_copy", "cpu", "allreduce", "communication", _VLLM + "pynccl.py"),
    ("vllm::flashinfer_trtllm_fused_allreduce_norm", "cpu", "allreduce", "communication",
     "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"),
    ("vllm::patched_fused_scaled_matmul_reduce_scatter", "cpu", "reduce_scatter", "communication",
     "vllm/distributed/parallel_state.py"),
    ("_C_custom_ar::all_reduce", "cpu", "allreduce", "communication", "vllm/_custom_ops.py"),
    ("_C_custom_ar::qr_all_reduce", "cpu", "allreduce", "communication", "vllm/_custom_ops.py (quick all-reduce)"),
    ("_C_custom_ar::custom_all_gather", "cpu", "allgather", "communication", "vllm/_custom_ops.py"),
    ("_C_custom_ar::custom_reduce_scatter", "cpu", "reduce_scatter", "communication", "vllm/_custom_ops.py"),
    ("symm_mem::two_shot_all_reduce_", "cpu", "allreduce", "communication", _VLLM + "symm_mem.py"),
    ("symm_mem::multimem_all_reduce_", "cpu", "allreduce", "communication", _VLLM + "symm_mem.py"),
    ("symm_mem::one_shot_all_reduce", "cpu", "allreduce", "communication", "torch.ops.symm_mem (libtorch)"),
    ("symm_mem::fused_all_gather_matmul", "cpu", "allgather", "communication", "torch/distributed/_symmetric_memory"),
    # torch functional collectives and their wait (the wait must win over any generic c10d rule)
    ("_c10d_functional::wait_tensor", "cpu", "collective_wait", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d_functional::wait_tensor", "cpu", "collective_wait", "communication", "libtorch_cpu legacy c10d_functional"),
    ("_c10d_functional::all_reduce", "cpu", "allreduce", "communication", "real trace (torch 2.13 gloo)"),
    ("_c10d_functional::all_reduce_", "cpu", "allreduce", "communication", "torch/distributed/_functional_collectives.py"),
    ("_c10d_functional::all_reduce_coalesced", "cpu", "allreduce", "communication",
     "torch/distributed/_functional_collectives.py"),
    ("_c10d_functional::all_gather_into_tensor", "cpu", "allgather", "communication", "real trace (torch 2.13 gloo)"),
    ("_c10d_functional::all_gather_into_tensor_coalesced", "cpu", "allgather", "communication",
     "torch/distributed/_functional_collectives.py"),
    ("_c10d_functional::reduce_scatter_tensor", "cpu", "reduce_scatter", "communication",
     "real trace (torch 2.13 gloo)"),
    ("_c10d_functional::all_to_all_single", "cpu", "all_to_all", "communication", "real trace (torch 2.13 gloo)"),
    ("_c10d_functional::broadcast", "cpu", "collective_other", "communication", "real trace (torch 2.13 gloo)"),
    # c10d ops (torch.distributed), gloo, record_param_comms
    ("c10d::_allgather_base_", "cpu", "allgather", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::allgather_into_tensor_coalesced_", "cpu", "allgather", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::_reduce_scatter_base_", "cpu", "reduce_scatter", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::reduce_scatter_tensor_coalesced_", "cpu", "reduce_scatter", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::alltoall_base_", "cpu", "all_to_all", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::allreduce_coalesced_", "cpu", "allreduce", "communication", "libtorch_cpu c10d op schema"),
    ("c10d::barrier", "cpu", "collective_other", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::send", "cpu", "send_recv", "communication", "real trace (torch 2.13 gloo)"),
    ("c10d::recv_", "cpu", "send_recv", "communication", "libtorch_cpu c10d op schema"),
    ("gloo:all_gather", "cpu", "allgather", "communication", "real trace (torch 2.13 gloo)"),
    ("gloo:all_to_all", "cpu", "all_to_all", "communication", "real trace (torch 2.13 gloo)"),
    ("gloo:send", "cpu", "send_recv", "communication", "real trace (torch 2.13 gloo)"),
    ("record_param_comms", "cpu", "collective_other", "communication", "torch/csrc/distributed/c10d/ParamCommsUtils"),
]


def test_at_least_thirty_new_collective_names_each_with_a_source():
    assert len(COLLECTIVE_NAMES) >= 30
    assert all(source for *_, source in COLLECTIVE_NAMES)


@pytest.mark.parametrize("name,device,category,cls,source", COLLECTIVE_NAMES,
                         ids=[f"{d}:{n[:60]}" for n, d, *_ in COLLECTIVE_NAMES])
def test_collective_category_and_class(name, device, category, cls, source):
    got = categorize_name(name, device)
    assert got == category, f"{name} ({source})"
    assert verdict.class_of(got) == cls


@pytest.mark.parametrize("name", ["cudaStreamWaitEvent", "aten::wait", "cudaEventSynchronize"])
def test_stream_and_future_waits_are_not_collective_waits(name):
    assert categorize_name(name, "cpu") not in cz.WAIT_CATEGORIES


def test_aten_gather_is_indexing_not_all_gather():
    assert categorize_name("aten::gather", "cpu") == "elementwise_other"


# ---- one source: the rules file names each category's class --------------------------------------
def _raw_rules():
    return yaml.safe_load(cz.DEFAULT_RULES.read_text())


def test_every_category_in_the_rules_file_has_a_verdict_class():
    for device in ("gpu", "cpu"):
        for i, rule in enumerate(_raw_rules()[device]):
            assert rule.get("class") in cz.VERDICT_CLASSES, f"{device}[{i}] {rule.get('category')}: no class"
            assert verdict.class_of(rule["category"]) == rule["class"]


def test_other_stays_visible_as_its_own_class():
    assert verdict.class_of(OTHER) == OTHER
    assert cz.category_classes()[OTHER] == OTHER


def test_collective_sets_derive_from_the_rules_file():
    assert set(cz.ALLREDUCE_CATEGORIES) == {"allreduce_nccl", "allreduce_custom", "allreduce"}
    assert cz.WAIT_CATEGORIES == ("collective_wait",)
    classes = cz.category_classes()
    for cat in cz.COMM_CATEGORIES_GPU + cz.COMM_CATEGORIES_CPU:
        assert classes[cat] == "communication"


def _write_rules(tmp_path, gpu_rules):
    p = tmp_path / "rules.yaml"
    p.write_text(yaml.safe_dump({"gpu": gpu_rules, "cpu": []}))
    return p


def test_a_rule_without_a_valid_class_is_refused_naming_file_rule_and_valid_classes(tmp_path):
    p = _write_rules(tmp_path, [{"category": "gemm_dense", "class": "gemm", "pattern": "gemm"},
                                {"category": "mystery", "pattern": "xyz"}])
    with pytest.raises(ValueError) as e:
        cz.load_rules(p)
    msg = str(e.value)
    assert str(p) in msg and "gpu[1]" in msg and "mystery" in msg
    assert all(c in msg for c in cz.VERDICT_CLASSES)


def test_one_category_with_two_classes_is_refused(tmp_path):
    p = _write_rules(tmp_path, [{"category": "x", "class": "gemm", "pattern": "a"},
                                {"category": "x", "class": "small ops", "pattern": "b"}])
    with pytest.raises(ValueError, match=r"gpu\[1\].*differ from gpu\[0\]"):
        cz.load_rules(p)


def test_an_unknown_collective_is_refused(tmp_path):
    p = _write_rules(tmp_path, [{"category": "x", "class": "communication", "collective": "allreduce",
                                 "pattern": "a"}])
    with pytest.raises(ValueError, match="valid: all_reduce"):
        cz.load_rules(p)


def test_rules_are_parsed_once_per_content_then_read_from_the_cache(tmp_path, repo):
    """The first load of a rules file caches its parsed form under the hash of its bytes; a fresh
    interpreter then loads the same rules without PyYAML; an edited file is parsed anew, not served
    stale; a bad rule in it is still named."""
    import subprocess
    import sys

    src = (repo / "params" / "kernel_categories.yaml").read_text()
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(src)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(repo / "lib")}
    code = ("import sys; from decodescope.trace.categorize import load_rules, categorize_name; "
            "r = load_rules(sys.argv[1]); print(categorize_name('ncclDevKernel_AllReduce_Sum_bf16_RING_LL', 'gpu', r), "
            "len(r.gpu), 'yaml' in sys.modules)")

    def load():
        out = subprocess.run([sys.executable, "-c", code, str(rules_file)], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    cached = lambda: sorted(p.name for p in (tmp_path / "cache" / "decodescope").glob("rules-*"))  # noqa: E731
    first = load()
    assert len(cached()) == 1 and not [n for n in cached() if n.endswith(".tmp")]
    second = load()
    assert second[:2] == first[:2] and second[2] == "False"  # the categorize import itself may load yaml
    rules_file.write_text(src.replace("allreduce_nccl", "allreduce_nccl_edited"))
    edited = load()
    assert edited[0] == "allreduce_nccl_edited" != first[0] and len(cached()) == 2
    for bad, why in ((src.replace("pattern: '^(Memcpy|Memset)", "pattern: '^((Memcpy|Memset)", 1), "not a valid regex"),
                     (src.replace("pattern: '^(Memcpy|Memset)", "pattern: {'^(Memcpy|Memset)", 1), "not valid YAML")):
        rules_file.write_text(bad)
        out = subprocess.run([sys.executable, "-c", code, str(rules_file)], capture_output=True, text=True, env=env)
        assert out.returncode != 0 and why in out.stderr and str(rules_file) in out.stderr, out.stderr
