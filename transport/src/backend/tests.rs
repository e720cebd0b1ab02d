use super::*;

#[test]
fn choices_parse() {
    assert_eq!(
        "auto".parse::<BackendChoice>().ok(),
        Some(BackendChoice::Auto)
    );
    assert_eq!(
        "io_uring".parse::<BackendChoice>().ok(),
        Some(BackendChoice::IoUring)
    );
    assert_eq!(
        "epoll".parse::<BackendChoice>().ok(),
        Some(BackendChoice::Epoll)
    );
    assert!("kqueue".parse::<BackendChoice>().is_err());
}

#[test]
fn auto_resolves_to_uring_exactly_when_it_is_usable() {
    let resolved = BackendChoice::Auto.resolve().expect("auto never fails");
    match uring_support() {
        Ok(()) => assert_eq!(resolved.backend, Backend::IoUring),
        Err(reason) => {
            assert_eq!(resolved.backend, Backend::Epoll);
            assert_eq!(resolved.fallback, Some(reason));
        }
    }
}

#[test]
fn forced_epoll_never_probes_into_an_error() {
    let resolved = BackendChoice::Epoll
        .resolve()
        .expect("epoll is always there");
    assert_eq!(resolved.backend, Backend::Epoll);
    assert_eq!(resolved.fallback, None);
}

#[test]
fn block_on_runs_local_tasks_on_both_backends() {
    for backend in [Backend::Epoll, Backend::IoUring] {
        if backend == Backend::IoUring && uring_support().is_err() {
            continue;
        }
        let got = block_on(backend, async {
            tokio::task::spawn_local(async { 7 }).await.unwrap_or(0)
        })
        .expect("runtime builds");
        assert_eq!(got, 7, "{backend}");
    }
}
