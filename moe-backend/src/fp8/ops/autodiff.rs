//! `Fp8Ops` for `Autodiff<B>`: the fprop saves `x` and `W` (high precision, as the module
//! holds them anyway); its backward runs the FP8 dgrad (`dx`) and wgrad (`dW`) of the inner
//! backend. dgrad and wgrad themselves are not differentiable.

use burn::backend::{
    AutodiffBackend, TensorMetadata,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    },
    tensor::FloatTensor,
};

use super::Fp8Ops;
use crate::fp8::recipe::Fp8Recipe;

impl<B: Fp8Ops, C: CheckpointStrategy> Fp8Ops for Autodiff<B, C> {
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct Fp8GroupedMatmulBackward;

        impl<B: Fp8Ops> Backward<B, 2> for Fp8GroupedMatmulBackward {
            /// `(x, weights, group_sizes, recipe)`.
            type State = (FloatTensor<B>, FloatTensor<B>, Vec<usize>, Fp8Recipe);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _: &mut Checkpointer,
            ) {
                let [x_parent, w_parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x, w, sizes, recipe) = ops.state;
                if let Some(node) = w_parent {
                    let dw = B::fp8_grouped_matmul_wgrad(grad.clone(), x, sizes.clone(), recipe);
                    // A 2-D `[M, K]` weight (one group) gets its gradient in its own shape.
                    let w_shape = w.shape();
                    let dw = if w_shape.num_dims() == 2 {
                        B::float_reshape(dw, w_shape)
                    } else {
                        dw
                    };
                    grads.register::<B>(node.id, dw);
                }
                if let Some(node) = x_parent {
                    let dx = B::fp8_grouped_matmul_dgrad(grad, w, sizes, recipe);
                    grads.register::<B>(node.id, dx);
                }
            }
        }

        match Fp8GroupedMatmulBackward
            .prepare::<C>([x.node(), weights.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let xp = x.into_primitive();
                let wp = weights.into_primitive();
                let out =
                    B::fp8_grouped_matmul(xp.clone(), wp.clone(), group_sizes.clone(), recipe);
                prep.finish((xp, wp, group_sizes, recipe), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fp8_grouped_matmul(
                x.into_primitive(),
                weights.into_primitive(),
                group_sizes,
                recipe,
            )),
        }
    }

    fn fp8_grouped_matmul_dgrad(
        grad: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::fp8_grouped_matmul_dgrad(
            grad.into_primitive(),
            weights.into_primitive(),
            group_sizes,
            recipe,
        ))
    }

    fn fp8_grouped_matmul_wgrad(
        grad: FloatTensor<Self>,
        x: FloatTensor<Self>,
        group_sizes: Vec<usize>,
        recipe: Fp8Recipe,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::fp8_grouped_matmul_wgrad(
            grad.into_primitive(),
            x.into_primitive(),
            group_sizes,
            recipe,
        ))
    }
}
