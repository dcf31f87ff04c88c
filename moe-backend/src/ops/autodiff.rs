//! `MoeOps` for `Autodiff<B>`: every differentiable op gets a hand-written backward pass built from
//! the inner backend's `MoeOps` kernels (docs/routing-and-dispatch.md §Permute and unpermute,
//! §Chunk sorting, §Grouped GEMM).
//!
//! | op | backward |
//! |---|---|
//! | `permute(x, idx)` | `dx = unpermute(dy, idx)` (scatter-add of the k copies) |
//! | `unpermute(rows, idx, p)` | `d_rows = permute(dy, idx) · p`, `d_p = ⟨permute(dy, idx), rows⟩` |
//! | `gmm(x, W)` OutIn | `dx = gmm(dy, W)` InOut, `dW = wgrad(dy, x)` |
//! | `gmm(x, W)` InOut | `dx = gmm(dy, W)` OutIn, `dW = wgrad(x, dy)` |
//! | `wgrad(a, b)` | `da = gmm(b, dOut)` OutIn, `db = gmm(a, dOut)` InOut |
//! | `sort_chunks(x, s, o)` | the inverse reorder |
//! | `swiglu(h, p)` | fused: `d_gate`, `d_up`, `d_p` in one pass |
//! | `attach_loss(x, L, c)` | `dx = dy`, `dL = c` |

use burn::backend::{
    AutodiffBackend, TensorMetadata,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::{BoolTensor, FloatTensor, IntTensor},
};
use burn::tensor::{FloatDType, Shape};

use super::MoeOps;

/// `[N]` probs as an `[N, 1]` column for broadcasting against `[N, H]` rows.
fn column<B: MoeOps>(p: FloatTensor<B>) -> FloatTensor<B> {
    let n = p.shape()[0];
    B::float_reshape(p, Shape::new([n, 1]))
}

impl<B: MoeOps, C: CheckpointStrategy> MoeOps for Autodiff<B, C> {
    fn moe_routing_index(
        routing_map: BoolTensor<Self>,
        capacity: Option<usize>,
    ) -> (IntTensor<Self>, IntTensor<Self>, IntTensor<Self>) {
        B::moe_routing_index(routing_map, capacity)
    }

    fn moe_topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        B::moe_topk_indices(scores.into_primitive(), k)
    }

    fn moe_permute(
        tokens: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct PermuteBackward;

        impl<B: MoeOps> Backward<B, 1> for PermuteBackward {
            type State = (IntTensor<B>, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (idx, num_tokens) = ops.state;
                if let Some(node) = parent {
                    grads.register::<B>(node.id, B::moe_unpermute(grad, idx, num_tokens));
                }
            }
        }

        match PermuteBackward
            .prepare::<C>([tokens.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let num_tokens = tokens.primitive().shape()[0];
                let out = B::moe_permute(tokens.into_primitive(), sorted_indices.clone());
                prep.finish((sorted_indices, num_tokens), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::moe_permute(tokens.into_primitive(), sorted_indices))
            }
        }
    }

    fn moe_unpermute(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct UnpermuteBackward;

        impl<B: MoeOps> Backward<B, 1> for UnpermuteBackward {
            type State = IntTensor<B>;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                if let Some(node) = parent {
                    grads.register::<B>(node.id, B::moe_permute(grad, ops.state));
                }
            }
        }

        match UnpermuteBackward
            .prepare::<C>([rows.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out =
                    B::moe_unpermute(rows.into_primitive(), sorted_indices.clone(), num_tokens);
                prep.finish(sorted_indices, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_unpermute(
                rows.into_primitive(),
                sorted_indices,
                num_tokens,
            )),
        }
    }

    fn moe_unpermute_weighted(
        rows: FloatTensor<Self>,
        sorted_indices: IntTensor<Self>,
        probs: FloatTensor<Self>,
        num_tokens: usize,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct WeightedUnpermuteBackward;

        impl<B: MoeOps> Backward<B, 2> for WeightedUnpermuteBackward {
            /// `(sorted_indices, rows, probs)`.
            type State = (IntTensor<B>, FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [rows_parent, probs_parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (idx, rows, probs) = ops.state;
                // dy gathered to the permuted rows: [N, H].
                let gathered = B::moe_permute(grad, idx);
                // Mixed precision (BF16 rows, f32 router probs): both gradients are computed in
                // the probs' precision and returned in each input's dtype (no casts when the
                // dtypes agree).
                let rows_dtype: FloatDType = rows.dtype().into();
                let wide: FloatDType = probs.dtype().into();
                let gathered = B::float_cast(gathered, wide);
                if let Some(node) = probs_parent {
                    let n = rows.shape()[0];
                    let rows = B::float_cast(rows, wide);
                    let dot = B::float_sum_dim(B::float_mul(gathered.clone(), rows), 1);
                    grads.register::<B>(node.id, B::float_reshape(dot, Shape::new([n])));
                }
                if let Some(node) = rows_parent {
                    let d_rows = B::float_mul(gathered, column::<B>(probs));
                    grads.register::<B>(node.id, B::float_cast(d_rows, rows_dtype));
                }
            }
        }

        match WeightedUnpermuteBackward
            .prepare::<C>([rows.node(), probs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let rows_p = rows.into_primitive();
                let probs_p = probs.into_primitive();
                let out = B::moe_unpermute_weighted(
                    rows_p.clone(),
                    sorted_indices.clone(),
                    probs_p.clone(),
                    num_tokens,
                );
                prep.finish((sorted_indices, rows_p, probs_p), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_unpermute_weighted(
                rows.into_primitive(),
                sorted_indices,
                probs.into_primitive(),
                num_tokens,
            )),
        }
    }

    fn moe_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
        transpose_weights: bool,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct GroupedMatmulBackward;

        impl<B: MoeOps> Backward<B, 2> for GroupedMatmulBackward {
            /// `(x, weights, group_sizes, transpose_weights)`.
            type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, bool);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [x_parent, w_parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x, w, sizes, trans) = ops.state;
                if let Some(node) = w_parent {
                    let dw = if trans {
                        B::moe_grouped_matmul_wgrad(grad.clone(), x, sizes.clone())
                    } else {
                        B::moe_grouped_matmul_wgrad(x, grad.clone(), sizes.clone())
                    };
                    grads.register::<B>(node.id, dw);
                }
                if let Some(node) = x_parent {
                    grads.register::<B>(node.id, B::moe_grouped_matmul(grad, w, sizes, !trans));
                }
            }
        }

        match GroupedMatmulBackward
            .prepare::<C>([x.node(), weights.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.into_primitive();
                let wp = weights.into_primitive();
                let out = B::moe_grouped_matmul(
                    xp.clone(),
                    wp.clone(),
                    group_sizes.clone(),
                    transpose_weights,
                );
                prep.finish((xp, wp, group_sizes, transpose_weights), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_grouped_matmul(
                x.into_primitive(),
                weights.into_primitive(),
                group_sizes,
                transpose_weights,
            )),
        }
    }

    fn moe_grouped_matmul_wgrad(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        group_sizes: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct WgradBackward;

        impl<B: MoeOps> Backward<B, 2> for WgradBackward {
            /// `(lhs [N, P], rhs [N, Q], group_sizes)`.
            type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [lhs_parent, rhs_parent] = ops.parents;
                // dOut [G, P, Q]; out_g = a_gᵀ b_g.
                let grad = grads.consume::<B>(&ops.node);
                let (a, b, sizes) = ops.state;
                if let Some(node) = lhs_parent {
                    // da_g = b_g · dOut_gᵀ: weights dOut [G, P(out), Q(in)].
                    let da = B::moe_grouped_matmul(b, grad.clone(), sizes.clone(), true);
                    grads.register::<B>(node.id, da);
                }
                if let Some(node) = rhs_parent {
                    // db_g = a_g · dOut_g: weights dOut [G, P(in), Q(out)].
                    grads.register::<B>(node.id, B::moe_grouped_matmul(a, grad, sizes, false));
                }
            }
        }

        match WgradBackward
            .prepare::<C>([lhs.node(), rhs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let a = lhs.into_primitive();
                let b = rhs.into_primitive();
                let out = B::moe_grouped_matmul_wgrad(a.clone(), b.clone(), group_sizes.clone());
                prep.finish((a, b, group_sizes), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_grouped_matmul_wgrad(
                lhs.into_primitive(),
                rhs.into_primitive(),
                group_sizes,
            )),
        }
    }

    fn moe_sort_chunks(
        x: FloatTensor<Self>,
        split_sizes: Vec<usize>,
        sorted_idxs: Vec<usize>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SortChunksBackward;

        impl<B: MoeOps> Backward<B, 1> for SortChunksBackward {
            /// `(split_sizes, sorted_idxs)` of the forward.
            type State = (Vec<usize>, Vec<usize>);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (sizes, order) = ops.state;
                if let Some(node) = parent {
                    // Output chunk j is input chunk order[j]; undo it.
                    let out_sizes: Vec<usize> = order.iter().map(|&c| sizes[c]).collect();
                    let mut inverse = vec![0usize; order.len()];
                    for (j, &c) in order.iter().enumerate() {
                        inverse[c] = j;
                    }
                    grads.register::<B>(node.id, B::moe_sort_chunks(grad, out_sizes, inverse));
                }
            }
        }

        match SortChunksBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::moe_sort_chunks(
                    x.into_primitive(),
                    split_sizes.clone(),
                    sorted_idxs.clone(),
                );
                prep.finish((split_sizes, sorted_idxs), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_sort_chunks(
                x.into_primitive(),
                split_sizes,
                sorted_idxs,
            )),
        }
    }

    fn moe_swiglu(hidden: FloatTensor<Self>, probs: FloatTensor<Self>) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SwigluBackward;

        impl<B: MoeOps> Backward<B, 2> for SwigluBackward {
            /// `(hidden, probs)`.
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [hidden_parent, probs_parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (hidden, probs) = ops.state;
                // Each gradient in its input's dtype (BF16 hidden, f32 router probs under
                // mixed precision).
                let (hidden_dtype, probs_dtype): (FloatDType, FloatDType) =
                    (hidden.dtype().into(), probs.dtype().into());
                let (dh, dp) = B::moe_swiglu_backward(hidden, probs, grad);
                if let Some(node) = hidden_parent {
                    grads.register::<B>(node.id, B::float_cast(dh, hidden_dtype));
                }
                if let Some(node) = probs_parent {
                    grads.register::<B>(node.id, B::float_cast(dp, probs_dtype));
                }
            }
        }

        match SwigluBackward
            .prepare::<C>([hidden.node(), probs.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let h = hidden.into_primitive();
                let p = probs.into_primitive();
                let out = B::moe_swiglu(h.clone(), p.clone());
                prep.finish((h, p), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_swiglu(
                hidden.into_primitive(),
                probs.into_primitive(),
            )),
        }
    }

    fn moe_swiglu_backward(
        hidden: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (dh, dp) = B::moe_swiglu_backward(
            hidden.into_primitive(),
            probs.into_primitive(),
            grad.into_primitive(),
        );
        (Self::from_inner(dh), Self::from_inner(dp))
    }

    fn moe_attach_loss(
        x: FloatTensor<Self>,
        loss: FloatTensor<Self>,
        grad_scale: f64,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct AttachLossBackward;

        impl<B: MoeOps> Backward<B, 2> for AttachLossBackward {
            /// `(loss shape, loss dtype, grad_scale)`.
            type State = (Shape, FloatDType, f64);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [x_parent, loss_parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (shape, dtype, scale) = ops.state;
                if let Some(node) = loss_parent {
                    let device = grad.device();
                    let ones = B::float_ones(shape, &device, dtype);
                    grads.register::<B>(node.id, B::float_mul_scalar(ones, scale.into()));
                }
                if let Some(node) = x_parent {
                    grads.register::<B>(node.id, grad);
                }
            }
        }

        match AttachLossBackward
            .prepare::<C>([x.node(), loss.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let shape = loss.primitive().shape();
                let dtype: FloatDType = loss.primitive().dtype().into();
                let lp = loss.into_primitive();
                let out = B::moe_attach_loss(x.into_primitive(), lp, grad_scale);
                prep.finish((shape, dtype, grad_scale), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::moe_attach_loss(
                x.into_primitive(),
                loss.into_primitive(),
                grad_scale,
            )),
        }
    }
}
