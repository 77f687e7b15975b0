//! Pods' requests as the extender reads them, and the reasons it refuses
//! what it cannot serve.

use super::*;
use crate::policy::{GpuPolicy, NodePolicy};
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::api::core::v1::{PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;

fn container(name: &str, limits: &[(&str, &str)]) -> Container {
    Container {
        name: name.into(),
        resources: Some(ResourceRequirements {
            limits: Some(
                limits
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect(),
            ),
            ..ResourceRequirements::default()
        }),
        ..Container::default()
    }
}

fn pod(containers: Vec<Container>, init: Vec<Container>) -> Pod {
    Pod {
        spec: Some(PodSpec {
            containers,
            init_containers: Some(init),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn parse(p: &Pod) -> Result<PodRequest, RequestError> {
    parse_pod(p, &ResourceNames::default(), &RequestDefaults::default())
}

#[test]
fn hami_resources_with_canonical_quantities() {
    let p = pod(
        vec![
            container(
                "main",
                &[
                    ("nvidia.com/gpu", "2"),
                    ("nvidia.com/gpumem", "3k"),
                    ("nvidia.com/gpucores", "30"),
                    ("nvidia.com/priority", "0"),
                ],
            ),
            container("sidecar-less", &[("cpu", "1")]),
        ],
        vec![container(
            "setup",
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem-percentage", "25"),
            ],
        )],
    );
    let request = parse(&p).expect("parse");
    assert_eq!(request.containers.len(), 2);
    let setup = &request.containers[0];
    assert_eq!(
        (setup.name.as_str(), setup.kind),
        ("setup", ContainerKind::Init)
    );
    assert_eq!(setup.memory, MemoryRequest::Percent(25));
    let main = &request.containers[1];
    assert_eq!(main.count, 2);
    assert_eq!(main.memory, MemoryRequest::Bytes(3000 << 20));
    assert_eq!(main.cores, 30);
    assert_eq!(main.priority, Some(0));
    assert!(!main.exclusive());
}

#[test]
fn defaults_apply_when_unset() {
    let p = pod(vec![container("main", &[("nvidia.com/gpu", "1")])], vec![]);
    assert_eq!(
        parse(&p).expect("parse").containers[0].memory,
        MemoryRequest::Whole
    );
    let request = parse_pod(
        &p,
        &ResourceNames::default(),
        &RequestDefaults {
            memory_mib: 1024,
            cores: 10,
        },
    )
    .expect("parse");
    assert_eq!(request.containers[0].memory, MemoryRequest::Bytes(1 << 30));
    assert_eq!(request.containers[0].cores, 10);
}

type ElasticCase<'a> = (&'a [(&'a str, &'a str)], u32, u32, MemoryRequest);

#[test]
fn elastic_gpu_resources() {
    let cases: &[ElasticCase] = &[
        (
            &[("elasticgpu.io/gpu-memory", "256")],
            1,
            0,
            MemoryRequest::Bytes(256 << 20),
        ),
        (
            &[("elasticgpu.io/gpu-core", "50")],
            1,
            50,
            MemoryRequest::Percent(50),
        ),
        (
            &[
                ("elasticgpu.io/gpu-core", "30"),
                ("elasticgpu.io/gpu-memory", "1024"),
            ],
            1,
            30,
            MemoryRequest::Bytes(1 << 30),
        ),
        (
            &[("elasticgpu.io/gpu-core", "200")],
            2,
            100,
            MemoryRequest::Whole,
        ),
    ];
    for (limits, count, cores, memory) in cases {
        // With the GPU count the webhook adds.
        let gpus = count.to_string();
        let mut with_count = limits.to_vec();
        with_count.push(("nvidia.com/gpu", &gpus));
        let request = parse(&pod(vec![container("c", &with_count)], vec![])).expect("parse");
        let c = &request.containers[0];
        assert_eq!(
            (c.count, c.cores, c.memory),
            (*count, *cores, *memory),
            "{limits:?}"
        );
        // Without it, the pod did not pass the webhook: refused.
        let error = parse(&pod(vec![container("c", limits)], vec![])).expect_err("no count");
        assert!(
            error
                .to_string()
                .contains("which vgpu's admission webhook adds"),
            "{error}"
        );
    }
    let error = parse(&pod(
        vec![container(
            "c",
            &[("elasticgpu.io/gpu-core", "150"), ("nvidia.com/gpu", "1")],
        )],
        vec![],
    ))
    .expect_err("150");
    assert!(error.to_string().contains("multiple of 100"), "{error}");
}

type CountCase<'a> = (&'a [(&'a str, &'a str)], Option<u64>);

#[test]
fn the_gpu_count_the_webhook_adds_for_elastic_requests() {
    let names = ResourceNames::default();
    let cases: &[CountCase] = &[
        (&[("elasticgpu.io/gpu-memory", "256")], Some(1)),
        (&[("elasticgpu.io/gpu-core", "30")], Some(1)),
        (&[("elasticgpu.io/gpu-core", "200")], Some(2)),
        (
            &[
                ("elasticgpu.io/gpu-core", "100"),
                ("elasticgpu.io/gpu-memory", "1k"),
            ],
            Some(1),
        ),
        // Already counted, nothing Elastic, or nothing at all.
        (
            &[("elasticgpu.io/gpu-core", "200"), ("nvidia.com/gpu", "2")],
            None,
        ),
        (&[("nvidia.com/gpu", "1")], None),
        (&[("elasticgpu.io/gpu-memory", "0")], None),
        (&[], None),
    ];
    for (limits, expected) in cases {
        let container = container("c", limits);
        assert_eq!(
            elastic_count_to_add(&container, &names),
            *expected,
            "{limits:?}"
        );
    }
    // With the count added, the request reads as before.
    let request = parse(&pod(
        vec![container(
            "c",
            &[("elasticgpu.io/gpu-core", "200"), ("nvidia.com/gpu", "2")],
        )],
        vec![],
    ))
    .expect("parse");
    let c = &request.containers[0];
    assert_eq!((c.count, c.cores, c.memory), (2, 100, MemoryRequest::Whole));
}

#[test]
fn bad_requests_say_what_is_wrong() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("nvidia.com/gpu", "-1")], "must not be negative"),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "-1")],
            "must not be negative",
        ),
        (&[("nvidia.com/gpu", "500m")], "whole number"),
        (&[("nvidia.com/gpu", "100")], "at most 16 GPUs"),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "150")],
            "from 0 to 100",
        ),
        (
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem-percentage", "0"),
            ],
            "from 1 to 100",
        ),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "0")],
            "no memory",
        ),
        (
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "20E")],
            "too large",
        ),
        (&[("nvidia.com/gpumem", "1024")], "add nvidia.com/gpu: 1"),
        (
            &[
                ("nvidia.com/gpu", "1"),
                ("nvidia.com/gpumem", "1"),
                ("nvidia.com/gpumem-percentage", "1"),
            ],
            "use one",
        ),
        (
            &[("nvidia.com/gpumem", "1"), ("elasticgpu.io/gpu-core", "10")],
            "use one kind",
        ),
        (
            &[("nvidia.com/gpu", "2"), ("elasticgpu.io/gpu-core", "10")],
            "come to 1 GPU(s)",
        ),
        (
            &[("nvidia.com/gpu", "1"), ("elasticgpu.io/gpu-core", "300")],
            "come to 3 GPU(s)",
        ),
        (&[("nvidia.com/gpu", "abc")], "not a Kubernetes quantity"),
    ];
    for (limits, expected) in cases {
        let error = parse(&pod(vec![container("c", limits)], vec![])).expect_err(expected);
        let text = error.to_string();
        assert!(
            text.contains(expected) && text.contains("\"c\""),
            "{limits:?}: {text}"
        );
    }
    // 10^12 MiB is a valid (if absurd) number: no GPU will fit it.
    let huge = parse(&pod(
        vec![container(
            "c",
            &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "1T")],
        )],
        vec![],
    ))
    .expect("parses");
    assert_eq!(
        huge.containers[0].memory,
        MemoryRequest::Bytes(1_000_000_000_000 << 20)
    );
}

#[test]
fn burst_annotation_is_a_whole_percentage() {
    let with = |value: &str| {
        let mut p = pod(
            vec![container(
                "c",
                &[("nvidia.com/gpu", "1"), ("nvidia.com/gpucores", "30")],
            )],
            vec![],
        );
        p.metadata.annotations = Some(BTreeMap::from([(
            "vgpu.io/gpucores-burst".to_string(),
            value.to_string(),
        )]));
        parse(&p)
    };
    assert_eq!(with("80").expect("80").burst_percent, Some(80));
    assert_eq!(with(" 100 ").expect("100").burst_percent, Some(100));
    for bad in ["0", "101", "-5", "50%", "lots", ""] {
        let error = with(bad).expect_err(bad).to_string();
        assert!(error.contains("vgpu.io/gpucores-burst"), "{bad}: {error}");
    }
    let plain = pod(vec![container("c", &[("nvidia.com/gpu", "1")])], vec![]);
    assert_eq!(parse(&plain).expect("plain").burst_percent, None);
}

#[test]
fn annotations_select_gpus_and_policies() {
    let mut p = pod(vec![container("c", &[("nvidia.com/gpu", "1")])], vec![]);
    p.metadata.annotations = Some(
        [
            ("nvidia.com/use-gputype", "A100, H100,"),
            ("nvidia.com/nouse-gputype", "MIG"),
            ("nvidia.com/use-gpuuuid", "GPU-a,GPU-b"),
            ("nvidia.com/nouse-gpuuuid", "GPU-c"),
            ("hami.io/gpu-scheduler-policy", "binpack"),
            ("hami.io/node-scheduler-policy", "spread"),
            ("vgpu.io/node-scheduler-policy", "random"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
    );
    let request = parse(&p).expect("parse");
    let s = &request.selectors;
    assert_eq!(s.use_types, vec!["a100", "h100"]);
    assert!(s.model_allowed("nvidia a100-sxm4-80gb").is_ok());
    assert_eq!(
        s.model_allowed("nvidia a100 mig 1g.10gb"),
        Err(TypeMismatch::Excluded(0))
    );
    assert_eq!(s.model_allowed("tesla v100"), Err(TypeMismatch::NotWanted));
    assert!(s.uuid_allowed("gpu-a").is_ok());
    assert_eq!(s.uuid_allowed("GPU-c"), Err(UuidMismatch::Excluded));
    assert_eq!(s.uuid_allowed("GPU-d"), Err(UuidMismatch::NotWanted));
    assert_eq!(request.gpu_policy, Some(GpuPolicy::Binpack));
    assert_eq!(
        request.node_policy,
        Some(NodePolicy::Random),
        "vgpu.io wins"
    );

    p.metadata.annotations = Some(
        [(
            "vgpu.io/gpu-scheduler-policy".to_string(),
            "tightest".to_string(),
        )]
        .into(),
    );
    let error = parse(&p).expect_err("unknown policy");
    assert!(
        error.to_string().contains("vgpu.io/gpu-scheduler-policy"),
        "{error}"
    );
}

#[test]
fn sidecars_are_recognised() {
    let mut sidecar = container(
        "proxy",
        &[("nvidia.com/gpu", "1"), ("nvidia.com/gpumem", "100")],
    );
    sidecar.restart_policy = Some("Always".into());
    let request = parse(&pod(vec![], vec![sidecar])).expect("parse");
    assert_eq!(request.containers[0].kind, ContainerKind::Sidecar);
}

#[test]
fn percentages_round_down_to_mib() {
    assert_eq!(MemoryRequest::Percent(50).bytes_on(16 << 30), 8 << 30);
    assert_eq!(MemoryRequest::Percent(33).bytes_on(1000 << 20), 330 << 20);
    assert_eq!(MemoryRequest::Percent(1).bytes_on((1 << 20) + 5), 1 << 20);
    assert_eq!(MemoryRequest::Whole.bytes_on(7), 7);
}

#[test]
fn the_gpu_model_annotation_names_one_whole_model_in_any_spelling() {
    let wanted = |name: &str| Selectors {
        model: Some(model_key(name)),
        ..Selectors::default()
    };
    let label_safe = wanted("NVIDIA-GeForce-GTX-1080");
    assert_eq!(label_safe.model_allowed("nvidia geforce gtx 1080"), Ok(()));
    assert_eq!(
        label_safe.model_allowed("nvidia geforce gtx 1080 ti"),
        Err(TypeMismatch::NotTheModel)
    );
    assert_eq!(
        wanted(" Tesla_V100-SXM2-32GB ").model_allowed("tesla v100-sxm2-32gb"),
        Ok(())
    );
    assert!(wanted("Tesla V100").restrict_models());
    assert!(!Selectors::default().restrict_models());
}
